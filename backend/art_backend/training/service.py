"""Trained models on disk and in serving: register, train a step, log, prune checkpoints.

Layout per model (ART's): `<art_dir>/<project>/models/<name>/`
    model.json                        name, project, base model, LoRA settings
    checkpoints/<step:04d>/           adapter_model.safetensors, adapter_config.json, optimizer.pt
    history.jsonl                     one line of metrics per train step and per logged split
    trajectories/<split>/<step:04d>.jsonl   the groups trained on (or logged), one per line
Step N is served as `<name>@<N>` and the newest as `<name>`; step 0 is the base model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_backend.engine.base import Engine
from art_backend.training.tokenize import TokenizeStats, TrainSequence, tokenize_trajectory
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup

logger = logging.getLogger(__name__)


class TrainingRequestError(ValueError):
    pass


class UnknownModelError(LookupError):
    pass


def group_advantages(rewards: list[float], scale: bool) -> list[float] | None:
    """A = (r - mean) / (std + 1e-6) per group (std division optional); None when all rewards
    are equal: such a group carries no signal."""
    if len(rewards) < 2 or max(rewards) - min(rewards) < 1e-9:
        return None
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) if scale else r - mean for r in rewards]


def reward_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std and the mean of every trajectory metric, over all trajectories."""
    trajectories = [t for g in groups for t in g.trajectories]
    rewards = [t.reward for t in trajectories]
    out: dict[str, float] = {
        "reward/mean": statistics.fmean(rewards) if rewards else math.nan,
        "reward/std": statistics.pstdev(rewards) if rewards else math.nan,
        "trajectories": len(trajectories),
        "exceptions": sum(len(g.exceptions) for g in groups),
    }
    values: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        for key, value in t.metrics.items():
            values[key].append(float(value))
    out.update({f"metrics/{key}": statistics.fmean(v) for key, v in values.items()})
    return out


@dataclass
class _Model:
    project: str
    name: str
    lora: LoraConfig
    directory: Path

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"


class TrainingService:
    def __init__(self, engine: Engine, art_dir: Path) -> None:
        self.engine = engine
        self.art_dir = Path(art_dir)
        self._models: dict[str, _Model] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    # ----- registry ---------------------------------------------------------------------

    def model(self, project: str, name: str) -> _Model:
        model = self._models.get(name)
        if model is None or model.project != project:
            raise UnknownModelError(
                f"Model {name!r} of project {project!r} is not registered on this backend: "
                "call `await model.register(backend)` first.")
        return model

    @staticmethod
    def steps(model: _Model) -> list[int]:
        if not model.checkpoints.is_dir():
            return []
        return sorted(int(p.name) for p in model.checkpoints.iterdir() if p.name.isdigit())

    def get_step(self, project: str, name: str) -> int:
        return max(self.steps(self.model(project, name)), default=0)

    async def register(self, project: str, name: str, base_model: str | None, lora: LoraConfig) -> dict[str, Any]:
        if base_model is not None and base_model != self.engine.base_model_name:
            raise TrainingRequestError(
                f"This backend serves {self.engine.base_model_name!r}, not {base_model!r}: start the backend "
                f"with --model pointing at {base_model!r}, or register with base_model="
                f"{self.engine.base_model_name!r}.")
        if name == self.engine.base_model_name or "@" in name:
            raise TrainingRequestError(f"Model name {name!r} is reserved or contains '@'; choose another name.")
        existing = self._models.get(name)
        if existing is not None and existing.project != project:
            raise TrainingRequestError(
                f"Model name {name!r} is already registered by project {existing.project!r}: served "
                "names must be unique on one backend.")
        directory = self.art_dir / project / "models" / name
        saved = directory / "model.json"
        if saved.is_file():  # a model keeps the adapter shape it started with
            lora = LoraConfig.model_validate(json.loads(saved.read_text())["lora"])
        try:
            self.engine.check_lora(lora)
        except ValueError as error:
            raise TrainingRequestError(str(error)) from error
        directory.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps({"project": project, "name": name, "base_model": self.engine.base_model_name,
                                     "lora": lora.model_dump()}, indent=2))
        model = _Model(project, name, lora, directory)
        self._models[name] = model
        step = self.get_step(project, name)
        for served in (name, f"{name}@{step}"):
            await self.engine.load_adapter(served, self._checkpoint(model, step))
        return {"step": step, "inference_name": name, "base_model": self.engine.base_model_name,
                "directory": str(directory)}

    def _checkpoint(self, model: _Model, step: int) -> Path | None:
        return None if step == 0 else model.checkpoints / f"{step:04d}"

    # ----- training ---------------------------------------------------------------------

    async def train(self, project: str, name: str, groups: list[TrajectoryGroup], config: TrainConfig,
                    dropped: list[str] | None = None) -> dict[str, Any]:
        model = self.model(project, name)
        async with self._locks[name]:
            started = time.perf_counter()
            step = self.get_step(project, name)
            sequences, metrics = self._prepare(groups, config)
            if dropped:
                metrics["groups/dropped"] = len(dropped)
                metrics["dropped_reasons"] = dropped
            if not sequences:
                metrics["trained"] = False
                metrics["note"] = ("No step taken: every group had equal rewards (no signal) or no model turns. "
                                   "Vary the scenario or the reward so rollouts of a group score differently.")
                return {"step": step, "metrics": metrics}
            staging = Path(tempfile.mkdtemp(prefix=".step-", dir=self._ensure(model.checkpoints)))
            try:
                trained = await self.engine.train_step(name, sequences, config, model.lora,
                                                       self._checkpoint(model, step), staging)
                final = model.checkpoints / f"{step + 1:04d}"
                os.replace(staging, final)  # a checkpoint appears whole or not at all
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            step += 1
            for served in (f"{name}@{step}", name):
                await self.engine.load_adapter(served, final)
            metrics.update(trained)
            metrics.update({"trained": True, "learning_rate": config.learning_rate,
                            "seconds": time.perf_counter() - started})
            self._record(model, step, "train", metrics, groups)
            return {"step": step, "metrics": metrics}

    @staticmethod
    def _ensure(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _prepare(self, groups: list[TrajectoryGroup], config: TrainConfig) -> tuple[list[TrainSequence], dict[str, Any]]:
        stats = TokenizeStats()
        sequences: list[TrainSequence] = []
        trained = skipped = 0
        for g, group in enumerate(groups):
            advantages = group_advantages([t.reward for t in group.trajectories], config.scale_rewards)
            if advantages is None:
                skipped += 1
                continue
            trained += 1
            for i, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages)):
                try:
                    sequences += tokenize_trajectory(trajectory, advantage, f"group {g}, trajectory {i}",
                                                     stats, config.max_sequence_length)
                except ValueError as error:
                    raise TrainingRequestError(str(error)) from error
        metrics: dict[str, Any] = reward_metrics(groups)
        metrics.update({
            "groups/trained": trained, "groups/skipped_zero_variance": skipped,
            "sequences": stats.sequences, "prefix_breaks": stats.prefix_breaks,
            "sequences_truncated": stats.truncated, "tokens/assistant": stats.assistant_tokens,
            "tokens/total": sum(len(s) for s in sequences),
        })
        return sequences, metrics

    async def log(self, project: str, name: str, groups: list[TrajectoryGroup], split: str) -> dict[str, Any]:
        model = self.model(project, name)
        step = self.get_step(project, name)
        metrics = reward_metrics(groups)
        self._record(model, step, split, metrics, groups)
        return {"step": step, "metrics": metrics}

    def _record(self, model: _Model, step: int, split: str, metrics: dict[str, Any],
                groups: list[TrajectoryGroup]) -> None:
        with (model.directory / "history.jsonl").open("a") as history:
            history.write(json.dumps({"step": step, "split": split, "time": time.time(), **metrics}) + "\n")
        folder = self._ensure(model.directory / "trajectories" / split)
        with (folder / f"{step:04d}.jsonl").open("a") as out:
            for group in groups:
                out.write(group.model_dump_json() + "\n")

    def history(self, project: str, name: str) -> list[dict[str, Any]]:
        path = self.model(project, name).directory / "history.jsonl"
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    async def delete_checkpoints(self, project: str, name: str, best_metric: str, best_split: str) -> dict[str, Any]:
        """Delete every checkpoint but the latest and the best by `best_metric` (higher is better)
        among `best_split` records of the history."""
        model = self.model(project, name)
        steps = self.steps(model)
        scores = {r["step"]: r[best_metric] for r in self.history(project, name)
                  if r.get("split") == best_split and isinstance(r.get(best_metric), (int, float))}
        keep = {max(steps, default=0)}
        scored = [s for s in steps if s in scores]
        if scored:
            keep.add(max(scored, key=lambda s: scores[s]))
        deleted = [s for s in steps if s not in keep]
        for step in deleted:
            shutil.rmtree(model.checkpoints / f"{step:04d}")
            await self.engine.remove_adapter(f"{name}@{step}")
        return {"deleted": deleted, "kept": sorted(keep & set(steps))}
