"""Trajectories: what an agent did in one rollout, with the exact tokens of each model turn.

The JSON shape follows ART's (`messages_and_choices`, `additional_histories`, `reward`,
`metrics`, `metadata`, `logs`): a message is an OpenAI message dict; a model turn is a
`Choice` in OpenAI's shape plus the exact `prompt_token_ids` and `token_ids` the backend saw
and produced (vLLM's `return_token_ids`), which is what training uses.
"""

from __future__ import annotations

import math
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TokenLogprob(BaseModel):
    token: str = ""
    logprob: float
    model_config = ConfigDict(extra="allow")


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    model_config = ConfigDict(extra="allow")


class Choice(BaseModel):
    """One model turn: the assistant message plus the exact tokens behind it."""

    message: dict[str, Any]
    finish_reason: str | None = None
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    model_config = ConfigDict(extra="allow")

    @classmethod
    def from_openai(cls, response: Any, index: int = 0) -> Choice:
        """Build from an `openai` ChatCompletion requested with `extra_body={"return_token_ids": True}`."""
        choice = response.choices[index]
        extra = choice.model_extra or {}
        return cls(
            message=choice.message.model_dump(exclude_none=True),
            finish_reason=choice.finish_reason,
            index=choice.index,
            logprobs=choice.logprobs.model_dump() if choice.logprobs is not None else None,
            prompt_token_ids=(response.model_extra or {}).get("prompt_token_ids"),
            token_ids=extra.get("token_ids"),
        )

    @property
    def token_logprobs(self) -> list[float] | None:
        if self.logprobs is None or self.logprobs.content is None:
            return None
        return [t.logprob for t in self.logprobs.content]


MessageOrChoice = Union[Choice, dict[str, Any]]
MetricValue = Union[float, int, bool]


def _as_message_or_choice(item: Any) -> Any:
    # A dict that carries a `message` is a serialised Choice; any other dict is a message.
    if isinstance(item, dict) and "message" in item and "role" not in item:
        return Choice.model_validate(item)
    return item


class History(BaseModel):
    """An extra conversation of a rollout: a sub-agent's calls, or a branch."""

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _parse_items(cls, items: Any) -> Any:
        return [_as_message_or_choice(i) for i in items] if isinstance(items, list) else items

    def choices(self) -> list[Choice]:
        return [item for item in self.messages_and_choices if isinstance(item, Choice)]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain OpenAI messages (choices become their assistant message)."""
        return [item.message if isinstance(item, Choice) else item for item in self.messages_and_choices]


class Trajectory(History):
    reward: float = 0.0
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics_are_numbers(cls, metrics: Any) -> Any:
        for key, value in (metrics.items() if isinstance(metrics, dict) else ()):
            if not isinstance(value, (int, float, bool)) or (isinstance(value, float) and math.isnan(value)):
                raise ValueError(
                    f"metric {key!r} is {value!r} ({type(value).__name__}); metrics must be numbers or "
                    "booleans. Put other values in `metadata` or `logs`."
                )
        return metrics

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_is_a_number(cls, reward: Any) -> Any:
        if isinstance(reward, (bool, str)):  # pydantic would read True as 1.0 and "0.5" as 0.5
            raise ValueError(f"reward must be a number, got {reward!r} ({type(reward).__name__})")
        return reward

    @field_validator("reward")
    @classmethod
    def _reward_is_finite(cls, reward: float) -> float:
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        return reward

    def add_response(self, response: Any, index: int = 0) -> Choice:
        """Append a model turn from an `openai` ChatCompletion (see `Choice.from_openai`)."""
        choice = Choice.from_openai(response, index)
        self.messages_and_choices.append(choice)
        return choice

    def histories(self) -> list[History]:
        """The main conversation first, then the additional ones."""
        return [self, *self.additional_histories]


class TrajectoryGroup(BaseModel):
    """Rollouts of one scenario, compared with each other to compute advantages."""

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[str] = Field(default_factory=list)  # tracebacks of rollouts that failed
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
