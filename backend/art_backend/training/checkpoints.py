"""A trained model's files, kept so that a crash (a kill, a power cut) loses nothing acknowledged.

Layout per model (ART's): `<art_dir>/<project>/models/<name>/`
    model.json                        name, project, base model, LoRA settings
    checkpoints/<step:04d>/           adapter_model.safetensors, adapter_config.json, optimizer.pt,
                                      step.json (the step's history record)
    history.jsonl                     one line of metrics per train step and per logged split
    trajectories/<split>/<step:04d>.jsonl   the groups trained on (or logged), one per line

A step is one unit: its checkpoint, history record and trajectories are written into a staging
directory, fsynced, and renamed into place (the commit: the step exists from then on, whole);
then published, the record appended to history.jsonl and the trajectories moved to theirs. A
restart rolls back staging directories (steps never committed) and finishes publishing
committed steps (`recover`). Damage found in a checkpoint is reported, never worked around:
`checkpoint_problem` says what is wrong, and only an explicit fall back moves damaged steps aside.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from art_backend.durable import append_lines, fsync_directory, fsync_tree, read_json_lines
from art_backend.errors import TrainingRequestError
from art_backend.kill_points import kill_point
from art_integrations.training import LoraConfig
from art_integrations.trajectory import TrajectoryGroup

logger = logging.getLogger(__name__)

STEP_RECORD = "step.json"
STEP_TRAJECTORIES = "trajectories.jsonl"  # inside a checkpoint until published
STEP_STAGING_PREFIX, _DELETING, _DAMAGED = ".step-", ".deleting-", ".damaged-"
CHECKPOINT_FILES = ("adapter_config.json", "adapter_model.safetensors", "optimizer.pt")


def checkpoint_problem(path: Path) -> str | None:
    """What keeps the checkpoint at `path` from loading (the file and the error), or None."""
    for name in CHECKPOINT_FILES:
        if not (path / name).is_file():
            return f"{path / name} is missing"
    try:
        rank = json.loads((path / "adapter_config.json").read_text())["r"]
        if not isinstance(rank, int):
            raise ValueError(f"its rank `r` is {rank!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{path / 'adapter_config.json'} does not load: {error!r}"
    for name, load in (("adapter_model.safetensors", lambda p: load_file(str(p))),
                       ("optimizer.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))):
        try:
            if not load(path / name):
                raise ValueError("it holds nothing")
        except Exception as error:  # noqa: BLE001 - every way a file fails to load is reported as such
            return f"{path / name} does not load: {type(error).__name__}: {error}"
    return None


@dataclass
class ModelFiles:
    project: str
    name: str
    lora: LoraConfig
    directory: Path
    trainable: bool = True  # False: a model only scored (logged) beside the trained ones

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"

    @property
    def history_path(self) -> Path:
        return self.directory / "history.jsonl"

    def trajectories_path(self, split: str, step: int) -> Path:
        return self.directory / "trajectories" / split / f"{step:04d}.jsonl"

    def steps(self) -> list[int]:
        """The committed steps."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit() and p.is_dir())

    def checkpoint(self, step: int) -> Path | None:
        """Step `step`'s checkpoint; None for step 0, the base model."""
        return None if step == 0 else self.checkpoints / f"{step:04d}"

    def kl_reference(self, step: int | None) -> Path | None:
        """The checkpoint a step's KL term is measured against (`TrainConfig.kl_reference_step`; None
        or 0: the base model); refused if the model does not keep it."""
        if not step:
            return None
        steps = self.steps()
        if step not in steps:
            have = (f"its newest is step {steps[-1]}" if steps and step > steps[-1] else
                    "it was deleted (delete_checkpoints keeps only some)" if steps else "it has no checkpoint yet")
            raise TrainingRequestError(f"Nothing was trained: kl_reference_step={step} names a checkpoint {self.name} "
                                       f"does not have ({have}). Name one it keeps (e.g. the step train_sft returned), "
                                       "or leave kl_reference_step out to measure the KL against the base model")
        return self.checkpoints / f"{step:04d}"

    def history(self) -> list[dict[str, Any]]:
        return [record for record in read_json_lines(self.history_path) if isinstance(record, dict)]

    # ----- a train step -------------------------------------------------------------------

    def new_staging(self) -> Path:
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=STEP_STAGING_PREFIX, dir=self.checkpoints))

    def commit(self, staging: Path, step: int, record: dict[str, Any], groups: list[TrajectoryGroup]) -> None:
        """Make the checkpoint the trainer wrote into `staging` step `step`, whole, with its
        history record and trajectories."""
        (staging / STEP_RECORD).write_text(json.dumps(record))
        (staging / STEP_TRAJECTORIES).write_text("".join(group.model_dump_json() + "\n" for group in groups))
        fsync_tree(staging)
        kill_point("checkpoint_written")
        os.replace(staging, self.checkpoints / f"{step:04d}")
        fsync_directory(self.checkpoints)

    def publish(self, step: int) -> None:
        """Append a committed step's record to the history and move its trajectories out; safe to
        repeat after a crash halfway."""
        checkpoint = self.checkpoints / f"{step:04d}"
        pending = checkpoint / STEP_TRAJECTORIES
        if not pending.exists():
            return  # published (or from before steps carried their records)
        record = json.loads((checkpoint / STEP_RECORD).read_text())
        if not any(r.get("step") == step and r.get("split") == "train" for r in self.history()):
            append_lines(self.history_path, [json.dumps(record)])
        kill_point("history_appended")
        target = self.trajectories_path("train", step)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(pending, target)
        fsync_directory(target.parent)
        fsync_directory(checkpoint)

    def record(self, record: dict[str, Any], split: str, groups: list[TrajectoryGroup]) -> None:
        """A logged split (no checkpoint): its record and groups, appended durably."""
        append_lines(self.history_path, [json.dumps(record)])
        if groups:
            append_lines(self.trajectories_path(split, record["step"]), [group.model_dump_json() for group in groups])

    # ----- after a crash, and damage --------------------------------------------------------

    def recover(self) -> None:
        """Finish what a crash interrupted: roll back uncommitted steps and unfinished deletions,
        publish committed steps that were not, each with a log line."""
        if not self.checkpoints.is_dir():
            return
        for leftover in sorted(self.checkpoints.iterdir()):
            if leftover.name.startswith(STEP_STAGING_PREFIX):
                shutil.rmtree(leftover)
                logger.warning("%s/%s: rolled back a train step the backend stopped during (it was never "
                               "acknowledged): removed %s", self.project, self.name, leftover)
            elif leftover.name.startswith(_DELETING):
                shutil.rmtree(leftover)
                logger.warning("%s/%s: finished deleting %s", self.project, self.name, leftover)
        for step in self.steps():
            if (self.checkpoints / f"{step:04d}" / STEP_TRAJECTORIES).exists():
                self.publish(step)
                logger.warning("%s/%s: step %d was committed but not published when the backend stopped: "
                               "finished it (history record and trajectories)", self.project, self.name, step)
        fsync_directory(self.checkpoints)

    def delete(self, step: int) -> None:
        """Remove a checkpoint: renamed out of the steps first, so a crash never leaves half of one."""
        doomed = self.checkpoints / f"{_DELETING}{step:04d}"
        os.replace(self.checkpoints / f"{step:04d}", doomed)
        fsync_directory(self.checkpoints)
        shutil.rmtree(doomed)

    def move_aside(self, step: int) -> Path:
        """Take a damaged step out of the run, keeping its files (and its trajectories) for a look."""
        target = self.checkpoints / f"{_DAMAGED}{step:04d}"
        suffix = 1
        while target.exists():
            suffix += 1
            target = self.checkpoints / f"{_DAMAGED}{step:04d}-{suffix}"
        os.replace(self.checkpoints / f"{step:04d}", target)
        trajectories = self.trajectories_path("train", step)
        if trajectories.exists():
            os.replace(trajectories, trajectories.with_name(f"{target.name}.jsonl"))
            fsync_directory(trajectories.parent)
        fsync_directory(self.checkpoints)
        return target
