"""Settings of a training step, sent to the backend: GRPO (`model.train()`) and SFT (`model.train_sft()`); and its answer."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from art_integrations.art_compat import names
from art_integrations.strict import StrictModel


class TrainConfig(StrictModel):
    # strict: a setting of the wrong type (`scale_rewards=0`, `learning_rate="1e-5"`) is refused, not guessed at
    model_config = ConfigDict(strict=True)
    ART_NAMES: ClassVar[dict[str, str]] = names.TRAIN_CONFIG_FIELDS

    learning_rate: float = Field(default=1e-5, gt=0)
    loss: Literal["cispo", "ppo"] = "cispo"
    epsilon: float | None = Field(default=None, ge=0, description="Lower clip; default 1.0 (CISPO), 0.2 (PPO).")
    epsilon_high: float | None = Field(default=None, ge=0, description="Upper clip; default 4.0 (CISPO), epsilon (PPO).")
    beta: float = Field(default=0.0, ge=0, description="KL coefficient to the reference policy: the base model "
                        "(adapter off), or the checkpoint `kl_reference_step` names.")
    kl_reference_step: int | None = Field(
        default=None, ge=0, description="With beta: the model's own checkpoint the KL is measured against, e.g. its "
        "SFT step, so GRPO stays near what the demonstrations taught (TRL's reference is the model training starts "
        "from; ART's kl_penalty_reference_step). None or 0: the base model.")
    scale_rewards: bool = Field(default=True, description="Divide advantages by the group's reward std.")
    max_grad_norm: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, gt=0, description="The temperature rollouts were sampled at.")
    micro_batch_tokens: int = Field(default=2048, ge=64, description="Tokens per forward/backward pass, padding "
                                    "included: a batch of packed prefix-tree rows, or of padded sequences where the "
                                    "trainer does not pack (activation memory grows with it).")
    gradient_checkpointing: bool = Field(default=True, description="Recompute each layer's activations in backward "
                                         "instead of keeping them from forward: a step's memory falls ~6x (SmolLM2, the "
                                         "main job's 1,247-token step: +1.7 GB -> +0.27 GB) for one more forward's time.")
    max_sequence_length: int = Field(default=4096, ge=16)
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"] = Field(
        default="token", description="ART's: the importance ratio of each token (token), of its whole sequence, the "
        "geometric mean of the tokens' ratios (sequence, GSPO's), or the arithmetic or geometric mean of the two "
        "(average, geometric_average); docs/training/grpo.md.")

    @model_validator(mode="after")
    def _reference_with_beta(self) -> TrainConfig:
        if self.kl_reference_step is not None and not self.beta:
            raise ValueError(f"kl_reference_step={self.kl_reference_step} names the KL term's reference, and the KL "
                             "term is off (beta=0): pass beta > 0 with it (e.g. beta=0.1), or leave it out")
        return self

    @model_validator(mode="after")
    def _level_with_loss(self) -> TrainConfig:
        if self.loss == "ppo" and self.importance_sampling_level in ("average", "geometric_average"):
            raise ValueError(f"importance_sampling_level={self.importance_sampling_level!r} is offered with "
                             "loss='cispo' only: PPO's clip takes the gradient through the ratio, and a mix of each "
                             "token's ratio with its sequence's is not computed so here. Use 'token' or 'sequence' "
                             "with PPO")
        return self


class LoraConfig(StrictModel):
    """The adapter trained for a model; fixed at its first step."""

    model_config = ConfigDict(strict=True)

    rank: int = Field(default=8, ge=1)
    alpha: int = Field(default=16, ge=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


class TrainSFTConfig(StrictModel):
    """ART 0.5.23's SFT settings (`art.TrainSFTConfig`), same names and defaults. One
    `model.train_sft()` is one checkpoint; inside it the trajectories are cut into batches of
    `batch_size`, one optimizer step each. `learning_rate`: one rate for every batch, or one per
    batch (a schedule, as `train_sft_from_file` makes). `assistant_turns`: train every assistant
    turn of a conversation, or only its last (the earlier ones are then context)."""

    learning_rate: float | list[float] = 5e-5
    batch_size: int | Literal["auto"] = "auto"  # "auto": 2 trajectories a batch, as ART's LocalBackend
    assistant_turns: Literal["all", "last"] = "all"

    @field_validator("learning_rate")
    @classmethod
    def _rates(cls, rate: float | list[float]) -> float | list[float]:
        # 0 is allowed: a linear schedule decays to it on its last batch
        rates = rate if isinstance(rate, list) else [rate]
        if not rates or any(not 0 <= r < 1 for r in rates):
            raise ValueError(f"learning_rate must be a rate in [0, 1) or a non-empty list of them, got {rate!r}")
        return rate

    @field_validator("batch_size")
    @classmethod
    def _batch(cls, size: int | str) -> int | str:
        if isinstance(size, int) and size < 1:
            raise ValueError(f"batch_size must be at least 1 (trajectories per optimizer step) or 'auto', got {size}")
        return size


class TrainResult(BaseModel):
    """A committed step: its number (served as `<name>@<step>`) and its metrics."""

    step: int
    metrics: dict[str, Any]
