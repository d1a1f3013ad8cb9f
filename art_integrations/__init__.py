"""Client side of ART integrations: capture agent rollouts and train them on an art-backend.

This package stays light (no torch): it talks to the backend over HTTP.
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
from art_integrations.model import TrainableModel, TrainResult
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import Choice, History, Trajectory, TrajectoryGroup

__version__ = "0.1.0"
__all__ = [
    "Backend",
    "BackendError",
    "GatheredGroups",
    "Choice",
    "History",
    "LocalBackend",
    "LoraConfig",
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
    "trajectory_group",
]
