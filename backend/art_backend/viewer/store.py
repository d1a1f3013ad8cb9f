"""Read-only access to what the training service stored under an art dir.

The layout is the training service's (`art_backend.training.service`):
`<art_dir>/<project>/models/<name>/` with `model.json`, `history.jsonl`,
`trajectories/<split>/<step:04d>.jsonl` and `checkpoints/<step:04d>/`. Names that come from a
URL are only ever matched against directory listings, never joined into a path as given, so a
crafted name cannot reach outside the art dir.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from art_backend.durable import read_json_lines
from art_integrations.trajectory import TrajectoryGroup


class NotInStore(LookupError):
    """A project, model, split or step that is not stored; says what is."""

    def __init__(self, what: str, name: str, where: str, available: list[str]) -> None:
        self.what, self.name, self.where, self.available = what, name, where, available
        listing = ", ".join(available) if available else "none"
        super().__init__(f"No {what} {name!r} in {where}. Stored: {listing}.")


@dataclass(frozen=True)
class StoredModel:
    project: str
    name: str
    directory: Path
    base_model: str | None  # the served base model's name when the model was registered
    lora: dict[str, Any]
    checkpoints: list[int]  # steps whose checkpoint still exists (others may have been deleted)

    @property
    def label(self) -> str:
        return f"{self.project}/{self.name}"


@dataclass(frozen=True)
class StoredStep:
    """The groups recorded for one split at one step, and the lines that could not be read
    (a line being appended while a step is still recorded, or a damaged file)."""

    split: str
    step: int
    groups: list[TrajectoryGroup]
    unreadable: list[str] = field(default_factory=list)


def _step_of(path: Path) -> int | None:
    return int(path.stem) if path.suffix == ".jsonl" and path.stem.isdigit() else None


class ArtStore:
    """Reads the files on every call, so a page reloaded during training shows the new steps."""

    def __init__(self, art_dir: Path) -> None:
        self.art_dir = Path(art_dir)

    def projects(self) -> list[str]:
        if not self.art_dir.is_dir():
            return []
        return sorted(p.name for p in self.art_dir.iterdir() if (p / "models").is_dir())

    def model_names(self, project: str) -> list[str]:
        models = self._project_dir(project) / "models"
        return sorted(p.name for p in models.iterdir() if p.is_dir())

    def model(self, project: str, name: str) -> StoredModel:
        names = self.model_names(project)
        if name not in names:
            raise NotInStore("model", name, f"project {project!r}", names)
        directory = self._project_dir(project) / "models" / name
        saved = self._read_json(directory / "model.json")
        checkpoints_dir = directory / "checkpoints"
        checkpoints = sorted(int(p.name) for p in checkpoints_dir.iterdir()
                             if p.is_dir() and p.name.isdigit()) if checkpoints_dir.is_dir() else []
        return StoredModel(project, name, directory, saved.get("base_model"), saved.get("lora") or {}, checkpoints)

    def models(self) -> list[StoredModel]:
        return [self.model(project, name) for project in self.projects() for name in self.model_names(project)]

    def history(self, model: StoredModel) -> list[dict[str, Any]]:
        """The history records in the order written; a damaged line is skipped (the trajectories
        of its step are still shown)."""
        return [record for record in read_json_lines(model.directory / "history.jsonl")
                if isinstance(record, dict) and isinstance(record.get("step"), int)
                and isinstance(record.get("split"), str)]

    def steps_by_split(self, model: StoredModel) -> dict[str, list[int]]:
        """The steps with stored trajectories, per split ("train" first, then by name)."""
        root = model.directory / "trajectories"
        if not root.is_dir():
            return {}
        found: dict[str, list[int]] = {}
        for split_dir in root.iterdir():
            steps = sorted(s for s in map(_step_of, split_dir.iterdir()) if s is not None) if split_dir.is_dir() else []
            if steps:
                found[split_dir.name] = steps
        return dict(sorted(found.items(), key=lambda item: (item[0] != "train", item[0])))

    def split_steps(self, model: StoredModel, split: str) -> list[int]:
        steps = self.steps_by_split(model)
        if split not in steps:
            raise NotInStore("split", split, model.label, list(steps))
        return steps[split]

    def step(self, model: StoredModel, split: str, step: str) -> StoredStep:
        """`step` as it came in a URL: only a stored step's number is accepted."""
        steps = self.split_steps(model, split)
        if step not in [str(s) for s in steps]:
            raise NotInStore("step", step, f"{model.label} split {split!r}", [str(s) for s in steps])
        step_number = int(step)
        path = model.directory / "trajectories" / split / f"{step_number:04d}.jsonl"
        groups: list[TrajectoryGroup] = []
        unreadable: list[str] = []
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                groups.append(TrajectoryGroup.model_validate_json(line))
            except ValidationError as error:
                unreadable.append(f"line {line_number}: {error.errors()[0]['msg']}")
        return StoredStep(split, step_number, groups, unreadable)

    def _project_dir(self, project: str) -> Path:
        projects = self.projects()
        if project not in projects:
            raise NotInStore("project", project, str(self.art_dir), projects)
        return self.art_dir / project

    @staticmethod
    def _read_json(path: Path) -> dict[str, Any]:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}


def finite(value: Any) -> float | None:
    """A number from a history record, or None for a missing, non-numeric or NaN value
    (the service writes NaN means for steps without trajectories)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
