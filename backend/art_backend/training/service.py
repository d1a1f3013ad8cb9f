"""Trained models on disk and in serving: register, train a step (GRPO or SFT), log, prune checkpoints.

The files and how each step is made durable are in `checkpoints.py`. Step N is served as
`<name>@<N>` and the newest as `<name>`; step 0 is the base model. After a restart every
committed step is served again (read from disk on first use).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import statistics
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from art_backend.chat_format import ChatFormatter
from art_backend.config import default_cache_dir
from art_backend.durable import write_atomically
from art_backend.engine.base import Engine, is_base_model
from art_backend.errors import BaseModelMismatchError, DamagedCheckpointError, TrainingRequestError, UnknownModelError
from art_backend.kill_points import kill_point
from art_backend.training import sync
from art_backend.training.checkpoints import ModelFiles, checkpoint_problem
from art_backend.training.mirror import StoreMirror
from art_backend.training.sft import Renderer, SFTRequestError, plan_sft
from art_backend.training.grpo import grpo_step, step_sequences
from art_backend.training.tokenize import TokenizeStats, TrainSequence
from art_integrations.training import LoraConfig, TrainConfig, TrainSFTConfig
from art_integrations.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:  # imported at the first step: peft (and accelerate) cost a serve-only process ~1 s
    from art_backend.training.trainer import LoraTrainer

logger = logging.getLogger(__name__)


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


class OneTrainer:
    """The backend's one trainer (every trained model's adapter on one base model), made when first
    called: on the model the engine lends (the torch engine's own), else on a copy loaded beside the
    engine's weights (`load_trainable_model`: Unsloth's on a GPU where it imports)."""

    def __init__(self) -> None:
        self._trainer: LoraTrainer | None = None

    def __call__(self, engine: Engine) -> LoraTrainer:
        from art_backend.training.base_model import load_trainable_model
        from art_backend.training.trainer import LoraTrainer

        lent = engine.lent_model()
        if lent is not None:
            if lent.trainer is None:
                lent.trainer = LoraTrainer(lent.model, step_memory=lent.step_memory)
            return lent.trainer
        if self._trainer is None:
            self._trainer = LoraTrainer(*load_trainable_model(engine.model_dir, engine.max_model_len))
        return self._trainer


def _add_client_metrics(metrics: dict[str, Any], client_metrics: dict[str, float] | None, refusal: str) -> None:
    """`client_metrics` into `metrics`; a name the step or split records itself is refused, not overwritten."""
    taken = sorted(set(client_metrics or {}) & set(metrics))
    if taken:
        raise TrainingRequestError(f"{refusal} {', '.join(map(repr, taken))} itself: name the client's metrics "
                                   "differently (e.g. 'pipeline/...')")
    metrics.update(client_metrics or {})


class TrainingService:
    def __init__(self, engine: Engine, art_dir: Path, cache_dir: Path | None = None,
                 trainer: OneTrainer | None = None, mirror: StoreMirror | None = None) -> None:
        """`trainer`: one the engine has already loaded (vLLM on a GPU loads it before sizing its memory).
        `mirror`: the checkpoint store every acknowledged change is pushed to (mirror.py)."""
        self.engine = engine
        self.mirror = mirror
        self.trainer = trainer or OneTrainer()
        self.art_dir = Path(art_dir)
        self.cache_dir = cache_dir or default_cache_dir()  # llama.cpp's sources and tools, for GGUF exports
        self._models: dict[str, ModelFiles] = {}
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.chat_formatter: ChatFormatter | None = None  # serving's, set by create_app; else the engine's default

    # ----- registry ---------------------------------------------------------------------

    def model(self, project: str, name: str, *, to_train: bool = False) -> ModelFiles:
        model = self._models.get(name)
        if model is None or model.project != project:
            raise UnknownModelError(
                f"Model {name!r} of project {project!r} is not registered on this backend: "
                "call `await model.register(backend)` first.")
        if to_train and not model.trainable:
            raise TrainingRequestError(f"Model {name!r} was registered to be scored only (a Model, not a "
                                       "TrainableModel): it has no adapter to train or checkpoints to delete.")
        return model

    def get_step(self, project: str, name: str) -> int:
        return max(self.model(project, name).steps(), default=0)

    def _model_directory(self, project: str, name: str) -> Path:
        if is_base_model(self.engine, name) or "@" in name:
            raise TrainingRequestError(f"Model name {name!r} is reserved or contains '@'; choose another name.")
        existing = self._models.get(name)
        if existing is not None and existing.project != project:
            raise TrainingRequestError(
                f"Model name {name!r} is already registered by project {existing.project!r}: served "
                "names must be unique on one backend.")
        directory = self.art_dir / project / "models" / name
        if not directory.resolve().is_relative_to(self.art_dir.resolve()):
            raise TrainingRequestError(f"{project!r}/{name!r} would put the model outside the art dir: use plain names.")
        return directory

    async def register_scored(self, project: str, name: str) -> dict[str, Any]:
        """A model only scored beside the trained ones (ART's `art.Model`, e.g. a prompted model
        elsewhere): its `log()` records go to its own history; nothing is served or trained."""
        directory = self._model_directory(project, name)
        model = ModelFiles(project, name, LoraConfig(), directory, trainable=False)
        if self.mirror is not None:
            await self.mirror.restore(model)
        if model.steps():
            raise TrainingRequestError(f"{project}/{name} has trained checkpoints: register it as a TrainableModel, "
                                       "or score the prompted model under another name.")
        async with self._locks[name]:
            self._save_description(model)
            self._models[name] = model
        return {"step": 0, "inference_name": name, "base_model": None, "directory": str(directory)}

    async def register(self, project: str, name: str, base_model: str | None, lora: LoraConfig,
                       fall_back: bool = False) -> dict[str, Any]:
        """Serve a model (every step of one trained before: `<name>@<N>`, the newest as `<name>`),
        after finishing what a crash left. A newest checkpoint that does not load is refused;
        with `fall_back` the damaged steps are moved aside and the model continues from the
        newest one that loads."""
        if base_model is not None and not is_base_model(self.engine, base_model):
            served = self.engine.base_model_name
            raise BaseModelMismatchError(
                f"Model {name!r} names base model {base_model!r}, but this backend serves {served!r} (one base per "
                f"backend; nothing was loaded or trained). Start another backend for it (`art-backend serve --model "
                f"{base_model}`, or LocalBackend(model={base_model!r})), or register with base_model={served!r}.")
        directory = self._model_directory(project, name)
        async with self._locks[name]:
            if self.mirror is not None:  # first what the store holds: a fresh node resumes where it says
                await self.mirror.restore(ModelFiles(project, name, LoraConfig(), directory))
            model = ModelFiles(project, name, self._checked_lora(self._stored_lora(project, name) or lora), directory)
            self._save_description(model)
            await asyncio.to_thread(model.recover)
            step = await self._newest_loadable(model, fall_back)
            await self._serve(model, step)
            self._models[name] = model
        return {"step": step, "inference_name": name, "base_model": self.engine.base_model_name,
                "directory": str(model.directory)}

    def _checked_lora(self, lora: LoraConfig) -> LoraConfig:
        """`lora`, if the engine can serve it (vLLM's max_lora_rank)."""
        try:
            self.engine.check_lora(lora)
        except ValueError as error:
            raise TrainingRequestError(str(error)) from error
        return lora

    def _stored_lora(self, project: str, name: str) -> LoraConfig | None:
        """A model keeps the adapter shape it started with."""
        saved = self.art_dir / project / "models" / name / "model.json"
        if not saved.is_file():
            return None
        try:
            described = json.loads(saved.read_text())
            if described.get("trainable") is False:  # scored only so far: the adapter starts now
                return None
            return LoraConfig.model_validate(described["lora"])
        except (ValueError, KeyError, TypeError) as error:
            raise DamagedCheckpointError(
                f"{saved} does not load ({error!r}): it holds the model's LoRA settings. Restore it, or remove it to "
                "register with the settings you pass (they must match the checkpoints').") from error

    def _save_description(self, model: ModelFiles) -> None:
        described = ({"base_model": self.engine.base_model_name, "lora": model.lora.model_dump()} if model.trainable
                     else {"trainable": False})
        text = json.dumps({"project": model.project, "name": model.name, **described}, indent=2)
        path = model.directory / "model.json"
        if not path.is_file() or path.read_text() != text:  # written whole or not at all, never in place
            write_atomically(path, text)

    async def _newest_loadable(self, model: ModelFiles, fall_back: bool) -> int:
        steps = model.steps()
        moved: list[int] = []
        loadable = 0
        for step in reversed(steps):
            checkpoint = model.checkpoint(step)
            assert checkpoint is not None
            problem = await asyncio.to_thread(checkpoint_problem, checkpoint)
            if problem is None:
                loadable = step
                break
            if not fall_back:
                older = [s for s in steps if s < step]
                raise DamagedCheckpointError(
                    f"Step {step} of {model.project}/{model.name} does not load, so training cannot continue from "
                    f"it: {problem}. Nothing was changed. Restore the file, or register with fall_back=True to "
                    f"move the damaged steps aside (kept under {model.checkpoints}/.damaged-*) and continue from "
                    f"the newest step that loads{f' (of {older})' if older else ' (the base model)'}.")
            aside = model.move_aside(step)
            moved.append(step)
            logger.warning("%s/%s: step %d does not load (%s); moved aside to %s, as asked (fall_back)",
                           model.project, model.name, step, problem, aside)
        if moved:  # the history says so too: the records of those steps no longer have checkpoints
            await asyncio.to_thread(model.record, {"step": loadable, "split": "fall_back", "time": time.time(),
                                                   "moved_aside": sorted(moved)}, "fall_back", [])
        return loadable

    async def _serve(self, model: ModelFiles, newest: int) -> None:
        """Every step as `<name>@<N>` (read on first use), the newest as `<name>` (read now)."""
        await self.engine.load_adapter(f"{model.name}@0", None)
        for step in model.steps():
            if step != newest:
                await self.engine.load_adapter(f"{model.name}@{step}", model.checkpoint(step), preload=False)
        for served in (f"{model.name}@{newest}", model.name):
            await self.engine.load_adapter(served, model.checkpoint(newest))

    # ----- training ---------------------------------------------------------------------

    async def train(self, project: str, name: str, groups: list[TrajectoryGroup], config: TrainConfig,
                    dropped: list[str] | None = None, client_metrics: dict[str, float] | None = None,
                    client_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """One GRPO step, acknowledged once it is durable on disk and served. `client_metrics` are
        recorded with it; `client_state` is kept in its record, committed with the checkpoint."""
        model = self.model(project, name, to_train=True)
        async with self._locks[name]:
            kill_point("step_started")
            started = time.perf_counter()
            reference = model.kl_reference(config.kl_reference_step)
            sequences, metrics = self._prepare(groups, config)
            if dropped:
                metrics["groups/dropped"] = len(dropped)
                metrics["dropped_reasons"] = dropped
            if not sequences:  # still a step (history line, `<name>@N`), so resumed loops and curves stay whole
                metrics["note"] = ("Nothing trained: every group had equal rewards (no signal) or no model turns; "
                                   "the step advanced with the adapter unchanged. Vary the scenario or the reward so "
                                   "rollouts of a group score differently.")
                logger.warning("%s/%s step %d: %s", project, name, self.get_step(project, name) + 1, metrics["note"])

            async def run(resume_from: Path | None, save_to: Path) -> dict[str, float]:
                return await self.engine.run_training(lambda: grpo_step(
                    self.trainer(self.engine), name, sequences, config, model.lora, resume_from, save_to, reference))

            return await self._commit_step(model, run, metrics, groups, started, {
                "trained": bool(sequences), "learning_rate": config.learning_rate,
                "scale_rewards": config.scale_rewards}, client_metrics, client_state)

    async def train_sft(self, project: str, name: str, trajectories: list[Trajectory],
                        config: TrainSFTConfig) -> dict[str, Any]:
        """One SFT step (sft.py): a checkpoint like a GRPO step's, served as `<name>@<N>`, in the
        history with its loss and tokens; the trajectories are kept as the step's one group."""
        model = self.model(project, name, to_train=True)
        async with self._locks[name]:
            kill_point("step_started")
            started = time.perf_counter()
            settings = TrainConfig()  # clipping, micro-batches and checkpointing as a GRPO step's defaults
            max_length = min(settings.max_sequence_length, self.engine.max_model_len)
            try:
                plan = await asyncio.to_thread(plan_sft, trajectories, config, self._renderer(), max_length,
                                               len(self.engine.tokenizer))
            except SFTRequestError as error:
                raise TrainingRequestError(f"Nothing was trained: {error}") from error

            async def run(resume_from: Path | None, save_to: Path) -> dict[str, float]:
                return await self.engine.run_training(lambda: self.trainer(self.engine).sft_step(
                    name, plan.batches, plan.learning_rates, settings, model.lora, resume_from, save_to))

            groups = [TrajectoryGroup(trajectories=trajectories, metadata={"kind": "sft"})]
            return await self._commit_step(model, run, plan.metrics, groups, started, {"trained": True})

    def _renderer(self) -> Renderer:
        """Serving's own formatter (create_app hands it over), so SFT renders as serving prompts."""
        if self.chat_formatter is None:
            self.chat_formatter = self.engine.chat_formatter(None, None)
        return Renderer.of(self.engine, self.chat_formatter)

    async def _commit_step(self, model: ModelFiles, run: Callable[[Path | None, Path], Awaitable[dict[str, float]]],
                           metrics: dict[str, Any], groups: list[TrajectoryGroup], started: float,
                           settings: dict[str, Any], client_metrics: dict[str, float] | None = None,
                           client_state: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train the next step (`run` from the newest checkpoint into a staging folder), commit it
        with its record and groups, publish and serve it as `<name>@<N>` and `<name>`."""
        step = self.get_step(model.project, model.name)
        staging = model.new_staging()
        try:
            metrics.update(await run(model.checkpoint(step), staging))
            metrics.update({**settings, "seconds": time.perf_counter() - started})
            _add_client_metrics(metrics, client_metrics, "Nothing was committed: the step records")
            record = {"step": step + 1, "split": "train", "time": time.time(), **metrics}
            if client_state is not None:
                record["client_state"] = client_state
            await asyncio.to_thread(model.commit, staging, step + 1, record, groups)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already once committed
        step += 1
        kill_point("step_committed")
        await asyncio.to_thread(model.publish, step)
        kill_point("step_published")
        for served in (f"{model.name}@{step}", model.name):
            await self.engine.load_adapter(served, model.checkpoint(step))
        if self.mirror is not None:  # acknowledged once it would outlive this node
            await self.mirror.save(model, f"Step {step}")
        return {"step": step, "metrics": metrics}

    def _prepare(self, groups: list[TrajectoryGroup], config: TrainConfig) -> tuple[list[TrainSequence], dict[str, Any]]:
        stats = TokenizeStats()
        sequences, trained, skipped = step_sequences(groups, config, stats, len(self.engine.tokenizer))
        metrics: dict[str, Any] = reward_metrics(groups)
        metrics.update({
            "groups/trained": trained, "groups/skipped_zero_variance": skipped,
            "groups/signal_share": trained / len(groups) if groups else 0.0,
            "sequences": stats.sequences, "prefix_breaks": stats.prefix_breaks,
            "sequences_truncated": stats.truncated, "tokens/assistant": stats.assistant_tokens,
            "tokens/total": sum(len(s) for s in sequences),
        })
        return sequences, metrics

    async def log(self, project: str, name: str, groups: list[TrajectoryGroup], split: str, step: int | None = None,
                  client_metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """Record a split's scores at `step` (default: the newest), without training."""
        model = self.model(project, name)
        newest = self.get_step(project, name)
        if step is not None and step > newest:
            raise TrainingRequestError(f"step {step} is not trained yet (the newest is {newest}): log a step's scores "
                                       "once it is")
        step = newest if step is None else step
        metrics = reward_metrics(groups) if groups else {}
        _add_client_metrics(metrics, client_metrics, "The split records")
        record = {"step": step, "split": split, "time": time.time(), **metrics}
        await asyncio.to_thread(model.record, record, split, groups)
        if self.mirror is not None:
            async with self._locks[name]:
                await self.mirror.save(model, f"The {split} scores of step {step}")
        return {"step": step, "metrics": metrics}

    # ----- export -------------------------------------------------------------------------

    async def export(self, project: str, name: str, step: int | None, format: str, out: Path, quant: str | None,
                     modelfile: bool) -> dict[str, Any]:
        """Write step `step` (default: the newest) as `format` to the folder `out` on this machine (see
        `art_backend.export`). Only checking and copying the adapter wait for a train step in progress."""
        from art_backend.export import BaseModel, build, plan

        model = self.model(project, name, to_train=True)
        base = BaseModel.of(self.engine.base_model_name, self.engine.model_dir)
        async with self._locks[name]:
            planned = await asyncio.to_thread(plan, model, step, format, out, base, self.cache_dir, quant, modelfile)
        return await asyncio.to_thread(build, planned)

    # ----- object storage -----------------------------------------------------------------

    async def push(self, project: str, name: str, url: str, options: dict[str, Any], delete: bool) -> dict[str, Any]:
        """Copy the model's files to `url` (see `sync.py`); no step commits while it runs."""
        model = self.model(project, name)
        async with self._locks[name]:
            return await asyncio.to_thread(sync.push, model, url, options, delete)

    async def pull(self, project: str, name: str, url: str, options: dict[str, Any],
                   step: int | Literal["latest"] | None, exclude: set[sync.Part]) -> dict[str, Any]:
        """Bring the model's files from `url` into the art dir. Before `register`, registering then
        resumes from the newest pulled step; after it, the pulled steps are served at once."""
        registered = self._models.get(name)
        if registered is not None and registered.project != project:
            self._model_directory(project, name)  # refuses the name taken by another project
        async with self._locks[name]:
            model = registered or ModelFiles(project, name, LoraConfig(), self._model_directory(project, name))
            result = await asyncio.to_thread(sync.pull, model, url, options, step, exclude)
            if registered is not None and registered.trainable and result["pulled"]:
                registered.lora = self._checked_lora(self._stored_lora(project, name) or registered.lora)
                await self._serve(registered, await self._newest_loadable(registered, fall_back=False))
        return result

    def history(self, project: str, name: str) -> list[dict[str, Any]]:
        return self.model(project, name).history()

    async def delete_checkpoints(self, project: str, name: str, best_metric: str, best_split: str) -> dict[str, Any]:
        """Delete every checkpoint but the latest and the best by `best_metric` (higher is better)
        among `best_split` records of the history."""
        model = self.model(project, name, to_train=True)
        async with self._locks[name]:
            steps = model.steps()
            scores = {r["step"]: r[best_metric] for r in model.history()
                      if r.get("split") == best_split and isinstance(r.get(best_metric), (int, float))}
            keep = {max(steps, default=0)}
            scored = [s for s in steps if s in scores]
            if scored:
                keep.add(max(scored, key=lambda s: scores[s]))
            deleted = [s for s in steps if s not in keep]
            for step in deleted:
                await self.engine.remove_adapter(f"{name}@{step}")
                await asyncio.to_thread(model.delete, step)
            if self.mirror is not None and deleted:  # else a backend started again would pull them back
                await self.mirror.save(model, f"Deleting steps {deleted}", delete=True)
        return {"deleted": deleted, "kept": sorted(keep & set(steps))}
