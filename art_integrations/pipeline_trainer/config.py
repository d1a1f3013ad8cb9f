"""The pipeline's settings in ART 0.5.23's names, and what of ART's PipelineTrainer is not offered
here: each such argument is refused by name with the way forward, never dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from art_integrations.strict import StrictModel


class PipelineRuntimeConfig(StrictModel):
    """How many rollouts run at once and how many groups a step trains (ART's
    `art.PipelineRuntimeConfig`, the same names and defaults). A step trains once
    `min_batch_size` groups with signal are queued, taking up to `max_batch_size` (default 10x
    the minimum) of those ready; `queue_maxsize` bounds the finished groups waiting (default
    `max_steps_off_policy * max_batch_size`)."""

    num_rollout_workers: int = Field(default=16, ge=1)
    min_batch_size: int = Field(default=4, ge=1)
    max_batch_size: int | None = Field(default=None, ge=1)
    queue_maxsize: int | None = Field(default=None, ge=1)
    # ART weighs its dashboard's score metrics by these; those metrics are not computed here
    score_reference_groups_per_step: float | None = Field(default=8.0, gt=0)
    score_reference_rollouts_per_group: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounds(self) -> PipelineRuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError(f"max_batch_size ({self.max_batch_size}) must be >= min_batch_size "
                             f"({self.min_batch_size})")
        if (self.score_reference_groups_per_step, self.score_reference_rollouts_per_group) != (8.0, None):
            raise ValueError("score_reference_groups_per_step and score_reference_rollouts_per_group weigh ART's "
                             "dashboard score metrics, which are not computed here: leave them out (each step's "
                             "reward/mean and reward/std are in model.history())")
        return self


class PipelineAutotuneConfig(StrictModel):
    """ART's autotuner of the pipeline's settings: not offered here, only `mode="off"` is taken."""

    mode: Literal["off"] = Field(default="off", description="ART's 'online' and 'profile' tune workers and batch "
                                 "sizes from its GPU metrics; here set PipelineRuntimeConfig(num_rollout_workers=..., "
                                 "min_batch_size=...) yourself")


# PipelineTrainer's ART arguments not offered here -> (the value that is what happens here anyway, the way forward)
NOT_OFFERED: dict[str, tuple[Any, str]] = {
    "loss_fn_config": (None, "the loss's settings are TrainConfig's (epsilon, epsilon_high, beta): pass "
                             "train_config=TrainConfig(...)"),
    "adam_params": (None, "the optimizer is AdamW at TrainConfig's learning_rate; its other settings are the trainer's"),
    "grad_accumulation_sequences": (None, "pass train_config=TrainConfig(micro_batch_tokens=...), tokens per "
                                          "forward/backward pass"),
    "kl_penalty_coef": (0.0, "pass train_config=TrainConfig(beta=...), a KL term in the loss toward the base model, "
                             "or with kl_reference_step=N toward step N's checkpoint (ART adjusts advantages instead)"),
    "kl_penalty_step_lag": (None, "the KL term here (TrainConfig(beta=...)) is toward the base model or a fixed "
                                  "step's checkpoint (kl_reference_step), not a lagged step"),
    "limit_mean_steps_off_policy": (None, "max_steps_off_policy bounds every group's staleness here"),
    "score_reference_groups_per_step": (None, "ART's dashboard score metrics are not computed here"),
    "score_reference_rollouts_per_group": (None, "ART's dashboard score metrics are not computed here"),
    "checkpoint_retention_strategy": (None, "every step is kept; await model.delete_checkpoints() keeps the newest "
                                            "and the best"),
    "rollout_executor": (None, "rollouts run in this process; to run them on a Ray cluster, call "
                               "RayRollouts(...).remote(rollout) inside rollout_fn"),
}
# ART arguments taken that change nothing here, and why
NO_EFFECT: dict[str, str] = {
    "save_checkpoint": "every step is saved and served as `name@step` here",
    "optimizer_save_interval": "the optimizer state is saved with every step's checkpoint here",
    "checkpoint_retention_interval": "every step is kept here (no retention strategy runs)",
}
