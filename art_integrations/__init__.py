"""Client side of ART integrations: capture agent rollouts and train them on an art-backend.

This package stays light (no torch): it talks to the backend over HTTP. ART's names are here
too (`Model`, `TrainableModel`, `Trajectory`, `TrajectoryGroup`, `TrainConfig`, `TrainSFTConfig`,
`gather_trajectory_groups`, `iterate_dataset`, `retry`, and ART 0.5.23's capture API:
`trajectory`, `trajectory_group`, `current_trajectory`, `no_capture`), so an ART script runs with
`import art_integrations as art` ([Coming from ART](../art.md) in the docs).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from art_integrations import dev
from art_integrations.art_compat.names import PACKAGE_NAMES, refuse_art_name
from art_integrations.capture import art_capture, trajectory
from art_integrations.capture.scope import current_capture, current_trajectory, no_capture
from art_integrations.gather import (
    GatheredGroups,
    TooManyRolloutErrors,
    gather_trajectories,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.dataset import DatasetBatch, iterate_dataset
from art_integrations.ray_rollouts import RayRollouts  # imports Ray only when a gather first uses it
from art_integrations.retry import retry
from art_integrations.dev import LoRAConfig  # ART 0.5.23's adapter settings, for TrainableModel(lora_config=...)
from art_integrations.training import LoraConfig, TrainConfig, TrainResult, TrainSFTConfig
from art_integrations.trajectory import Choice, History, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_integrations.backend import Backend, BackendError, LocalBackend, RemoteBackend
    from art_integrations.model import Model, TrainableModel
    from art_integrations.pipeline_trainer import PipelineAutotuneConfig, PipelineRuntimeConfig
    from art_integrations.ray_backend import RayBackend

# The backend clients load the openai SDK (~1 s): imported on first use (PEP 562), so that a process
# needing only the data types above (the backend itself: trajectories, train configs) goes without.
_ON_FIRST_USE = {
    **dict.fromkeys(["Backend", "BackendError", "LocalBackend", "RemoteBackend"], "art_integrations.backend"),
    **dict.fromkeys(["Model", "TrainableModel"], "art_integrations.model"),
    "RayBackend": "art_integrations.ray_backend",  # the backend as a Ray actor on a GPU node
    # ART 0.5.23's top-level names of its pipeline (art_integrations.pipeline_trainer)
    **dict.fromkeys(["PipelineAutotuneConfig", "PipelineRuntimeConfig"], "art_integrations.pipeline_trainer"),
}

__version__ = "0.1.0"
__all__ = [
    "Backend",
    "BackendError",
    "GatheredGroups",
    "Choice",
    "DatasetBatch",
    "History",
    "LoRAConfig",
    "LocalBackend",
    "LoraConfig",
    "Model",
    "PipelineAutotuneConfig",
    "PipelineRuntimeConfig",
    "RayBackend",
    "RayRollouts",
    "RemoteBackend",
    "TrainConfig",
    "TrainResult",
    "TrainSFTConfig",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "__version__",
    "TooManyRolloutErrors",
    "art_capture",
    "current_capture",
    "current_trajectory",
    "dev",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "no_capture",
    "retry",
    "trajectory",
    "trajectory_group",
]

def __getattr__(name: str) -> object:
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        globals()[name] = value  # looked up once
        return value
    refuse_art_name("art_integrations", name, PACKAGE_NAMES, "name")
    raise AttributeError(f"module 'art_integrations' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
