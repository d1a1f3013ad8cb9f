"""Client side of ART integrations: capture agent rollouts and train them on an art-backend.

This package stays light (no torch): it talks to the backend over HTTP. ART's names are here
too (`Model`, `TrainableModel`, `Trajectory`, `TrajectoryGroup`, `TrainConfig`,
`gather_trajectory_groups`, `iterate_dataset`, `retry`), so an ART script runs with
`import art_integrations as art` (README: "Coming from ART").
"""

from art_integrations.capture import art_capture, current_capture
from art_integrations.gather import (
    GatheredGroups,
    TooManyRolloutErrors,
    gather_trajectories,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.backend import Backend, BackendError, LocalBackend, RemoteBackend
from art_integrations.dataset import DatasetBatch, iterate_dataset
from art_integrations.model import Model, TrainableModel, TrainResult
from art_integrations.ray_rollouts import RayRollouts  # imports Ray only when a gather first uses it
from art_integrations.retry import retry
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import Choice, History, Trajectory, TrajectoryGroup

__version__ = "0.1.0"
__all__ = [
    "Backend",
    "BackendError",
    "GatheredGroups",
    "Choice",
    "DatasetBatch",
    "History",
    "LocalBackend",
    "LoraConfig",
    "Model",
    "RayRollouts",
    "RemoteBackend",
    "TrainConfig",
    "TrainResult",
    "TrainableModel",
    "Trajectory",
    "TrajectoryGroup",
    "__version__",
    "TooManyRolloutErrors",
    "art_capture",
    "current_capture",
    "gather_trajectories",
    "gather_trajectory_groups",
    "iterate_dataset",
    "retry",
    "trajectory_group",
]

# ART's names that have no counterpart here, each with what to use instead: a ported script
# then fails on the name with the way forward, not with a bare AttributeError
_ART_ONLY = {
    "dev": "engine and trainer settings belong to the backend (`art-backend serve --help`, ART_BACKEND_* "
           "variables); train settings are TrainConfig's",
    "auto_trajectory": "art_capture() records every model call of a rollout into its trajectory",
    "capture_auto_trajectory": "`async with art_capture() as trajectory:` around the rollout",
    "yield_trajectory": "return the Trajectory from the rollout",
    "capture_yielded_trajectory": "return the Trajectory from the rollout",
    "ServerlessBackend": "RemoteBackend(url, api_key=...) reaches an art-backend anywhere",
    "TrainSFTConfig": "only GRPO training is offered",
    "trajectory_group_batches": "iterate_dataset(...) batches scenarios into steps",
}


def __getattr__(name: str) -> object:
    if name in _ART_ONLY:
        raise AttributeError(f"art_integrations has no {name!r} (an ART name): {_ART_ONLY[name]}")
    raise AttributeError(f"module 'art_integrations' has no attribute {name!r}")
