"""ART's `art.pipeline_trainer`: train while rollouts run (trainer.py), with ART's names."""

from __future__ import annotations

from art_integrations.art_compat.names import PIPELINE_TRAINER_NAMES, refuse_art_name
from art_integrations.pipeline_trainer.config import PipelineAutotuneConfig, PipelineRuntimeConfig
from art_integrations.pipeline_trainer.trainer import PipelineTrainer
from art_integrations.pipeline_trainer.types import (
    ConfigT,
    EvalFn,
    RolloutFn,
    ScenarioT,
    SingleRolloutFn,
    make_group_rollout_fn,
)

__all__ = ["ConfigT", "EvalFn", "PipelineAutotuneConfig", "PipelineRuntimeConfig", "PipelineTrainer", "RolloutFn",
           "ScenarioT", "SingleRolloutFn", "make_group_rollout_fn"]


def __getattr__(name: str) -> object:
    refuse_art_name("art_integrations.pipeline_trainer", name, PIPELINE_TRAINER_NAMES, "name")
    raise AttributeError(f"module 'art_integrations.pipeline_trainer' has no attribute {name!r}")
