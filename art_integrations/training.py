"""Settings of a GRPO training step (sent to the backend with each `model.train()`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TrainConfig(BaseModel):
    # strict: a setting of the wrong type (`scale_rewards=0`, `learning_rate="1e-5"`) is refused, not guessed at
    model_config = ConfigDict(strict=True)

    learning_rate: float = Field(default=1e-5, gt=0)
    loss: Literal["cispo", "ppo"] = "cispo"
    epsilon: float | None = Field(default=None, ge=0, description="Lower clip; default 1.0 (CISPO), 0.2 (PPO).")
    epsilon_high: float | None = Field(default=None, ge=0, description="Upper clip; default 4.0 (CISPO), epsilon (PPO).")
    beta: float = Field(default=0.0, ge=0, description="KL coefficient to the base model (adapter off).")
    scale_rewards: bool = Field(default=True, description="Divide advantages by the group's reward std.")
    max_grad_norm: float = Field(default=1.0, gt=0)
    temperature: float = Field(default=1.0, gt=0, description="The temperature rollouts were sampled at.")
    micro_batch_tokens: int = Field(default=2048, ge=64, description="Tokens per forward/backward pass, padding "
                                    "included: a batch of packed prefix-tree rows, or of padded sequences where the "
                                    "trainer does not pack (activation memory grows with it).")
    max_sequence_length: int = Field(default=4096, ge=16)


class LoraConfig(BaseModel):
    """The adapter trained for a model; fixed at its first step."""

    model_config = ConfigDict(strict=True)

    rank: int = Field(default=8, ge=1)
    alpha: int = Field(default=16, ge=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
