"""Reading the trajectories a backend stored: `<art_dir>/<project>/models/<name>/trajectories/
<split>/<step:04d>.jsonl`, one TrajectoryGroup as JSON per line.

The file's step is the history's: train groups are filed under the step they trained into
(`train/0004.jsonl` holds the rollouts of policy step 3), logged splits under the step they
were logged at. `policy_step` is the checkpoint that produced the rollouts in either case.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from art_integrations.trajectory import TrajectoryGroup


@dataclass(frozen=True)
class StoredFile:
    path: Path
    split: str
    step: int  # as in history.jsonl

    @property
    def policy_step(self) -> int:
        return self.step - 1 if self.split == "train" else self.step


def model_dir(art_dir: Path, project: str, model: str) -> Path:
    return art_dir / project / "models" / model


def stored_files(art_dir: Path, project: str, model: str, split: str | None = None) -> list[StoredFile]:
    """The model's trajectory files, by split then step. FileNotFoundError says what exists instead."""
    folder = model_dir(art_dir, project, model) / "trajectories"
    if not folder.is_dir():
        models = sorted(p.parent.parent.name + "/" + p.name for p in art_dir.glob("*/models/*") if p.is_dir())
        raise FileNotFoundError(f"no stored trajectories at {folder}; models under {art_dir}: {models or 'none'}")
    splits = [folder / split] if split else sorted(p for p in folder.iterdir() if p.is_dir())
    return [StoredFile(path, directory.name, int(path.stem))
            for directory in splits for path in sorted(directory.glob("*.jsonl")) if path.stem.isdigit()]


def read_groups(path: Path) -> Iterator[TrajectoryGroup]:
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield TrajectoryGroup.model_validate_json(line)
                except ValueError as error:  # a line cut short by a crash, say: name where
                    raise ValueError(f"{path}, line {number}: not a TrajectoryGroup: {error}") from error
