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
from art_integrations.capture import art_capture, trajectory
from art_integrations.capture_scope import current_capture, current_trajectory, no_capture
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

# The backend clients load the openai SDK (~1 s): imported on first use (PEP 562), so that a process
# needing only the data types above (the backend itself: trajectories, train configs) goes without.
_ON_FIRST_USE = {
    **dict.fromkeys(["Backend", "BackendError", "LocalBackend", "RemoteBackend"], "art_integrations.backend"),
    **dict.fromkeys(["Model", "TrainableModel"], "art_integrations.model"),
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

# ART's names that have no counterpart here, each with what to use instead: a ported script
# then fails on the name with the way forward, not with a bare AttributeError
_ART_ONLY = {
    "auto_trajectory": "art_capture() records every model call of a rollout into its trajectory",
    "capture_auto_trajectory": "`async with art_capture() as trajectory:` around the rollout",
    "yield_trajectory": "return the Trajectory from the rollout",
    "capture_yielded_trajectory": "return the Trajectory from the rollout",
    "ServerlessBackend": "RemoteBackend(url, api_key=...) reaches an art-backend anywhere",
    "trajectory_group_batches": "iterate_dataset(...) batches scenarios into steps",
    # ART 0.5.23's
    "LocalTrainResult": "model.train() and backend.train() return TrainResult (step, metrics); checkpoints are "
                        "served as `name@step` once it returns",
    "ServerlessTrainResult": "model.train() and backend.train() return TrainResult (step, metrics)",
    "LocalServingUnavailableError": "a backend that cannot serve raises BackendError, naming why",
    "MegatronRuntimeConfig": "the backend trains LoRA with its own trainer (peft or Unsloth): `art-backend serve "
                             "--help` lists its settings",
    "MegatronTopologyConfig": "the backend's parallelism is vLLM's: --tensor-parallel-size, --data-parallel-size",
    "get_megatron_runtime_config": "the backend's settings are listed by `art-backend serve --help`",
    "init_megatron_runtime_config": "the backend's settings are listed by `art-backend serve --help`",
    "PipelineAutotuneConfig": "a training step here is one call: model.train(groups) between gathers",
    "PipelineRuntimeConfig": "a training step here is one call: model.train(groups) between gathers",
    "PIPELINE_RL_DASHBOARD_DEFAULT_METRICS": "each step's metrics come back from train() and go to history.jsonl",
    "PIPELINE_RL_METRIC_DEFINITIONS": "each step's metrics come back from train() and go to history.jsonl",
    "PIPELINE_RL_SCORE_METRICS": "each step's metrics come back from train() and go to history.jsonl",
    "MetricDefinition": "log metrics per trajectory (Trajectory.metrics) or with model.log(groups)",
    "get_tokenizer": "the backend tokenizes: every response carries its token_ids and prompt_token_ids",
    "tokenize": "the backend tokenizes trajectories itself from their exact token ids",
    "tensorize": "the backend builds the training tensors itself",
}


def __getattr__(name: str) -> object:
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        globals()[name] = value  # looked up once
        return value
    if name in _ART_ONLY:
        raise AttributeError(f"art_integrations has no {name!r} (an ART name): {_ART_ONLY[name]}")
    raise AttributeError(f"module 'art_integrations' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
