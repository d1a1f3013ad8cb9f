"""Trajectories: what an agent did in one rollout, with the exact tokens of each model turn.

The JSON shape follows ART's (`messages_and_choices`, `additional_histories`, `reward`,
`metrics`, `metadata`, `logs`): a message is an OpenAI message dict; a model turn is a
`Choice` in OpenAI's shape plus the exact `prompt_token_ids` and `token_ids` the backend saw
and produced (vLLM's `return_token_ids`), which is what training uses.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
from collections.abc import Awaitable, Generator, Iterable, Sequence
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_serializer, field_validator, model_validator

from art_integrations.strict import StrictModel


class TokenLogprob(BaseModel):
    token: str = ""
    logprob: float
    model_config = ConfigDict(extra="allow")


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    model_config = ConfigDict(extra="allow")


def _spelt_token_id(token: str) -> int | None:
    name, _, number = token.partition(":")
    return int(number) if name == "token_id" and number.isdigit() else None


class Choice(BaseModel):
    """One model turn: the assistant message plus the exact tokens behind it."""

    message: dict[str, Any]
    finish_reason: str | None = None
    index: int = 0
    logprobs: ChoiceLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _token_ids_from_logprobs(self) -> Choice:
        """ART's choices carry their token ids in the logprobs (vLLM's `return_tokens_as_token_ids`:
        each token spelt "token_id:N"): read them, so ART's trajectories keep their exact tokens."""
        if self.token_ids is None and self.logprobs is not None and self.logprobs.content:
            ids = [_spelt_token_id(t.token) for t in self.logprobs.content]
            if all(i is not None for i in ids):
                self.token_ids = ids  # type: ignore[assignment]
        return self

    @classmethod
    def from_openai(cls, response: Any, index: int = 0) -> Choice:
        """Build from an `openai` ChatCompletion requested with `extra_body={"return_token_ids": True}`."""
        return cls.from_openai_choice(response.choices[index], (response.model_extra or {}).get("prompt_token_ids"))

    @classmethod
    def from_openai_choice(cls, choice: Any, prompt_token_ids: list[int] | None = None) -> Choice:
        """Build from one `openai` Choice (`response.choices[i]`, what ART's rollouts append). Our
        backend puts the exact `token_ids` and `prompt_token_ids` on each choice; a choice without
        them cannot be trained on exactly, so it is refused here, saying how to ask for them."""
        extra = choice.model_extra or {}
        prompt_token_ids = extra.get("prompt_token_ids", prompt_token_ids)
        if extra.get("token_ids") is None or prompt_token_ids is None:
            raise ValueError(
                "this openai Choice carries no token ids (`token_ids` and `prompt_token_ids`), so it cannot be "
                "trained on exactly. Ask the backend for them: `extra_body={'return_token_ids': True}` in "
                "`chat.completions.create` (an art-backend sends them unless told `return_token_ids: false`), "
                "or capture the call with ChatART / art_capture().")
        return cls(
            message=choice.message.model_dump(exclude_none=True),
            finish_reason=choice.finish_reason,
            index=choice.index,
            logprobs=choice.logprobs.model_dump() if choice.logprobs is not None else None,
            prompt_token_ids=prompt_token_ids,
            token_ids=extra["token_ids"],
        )

    @property
    def token_logprobs(self) -> list[float] | None:
        if self.logprobs is None or self.logprobs.content is None:
            return None
        return [t.logprob for t in self.logprobs.content]


MessageOrChoice = Union[Choice, dict[str, Any]]
MetricValue = Union[float, int, bool]
PolicyVersion = Annotated[StrictInt, Field(ge=0)]  # strict: `true` is not a version


def _numbers_only(metrics: Any) -> Any:
    for key, value in (metrics.items() if isinstance(metrics, dict) else ()):
        if not isinstance(value, (int, float, bool)) or (isinstance(value, float) and math.isnan(value)):
            raise ValueError(
                f"metric {key!r} is {value!r} ({type(value).__name__}); metrics must be numbers or "
                "booleans. Put other values in `metadata` or `logs`."
            )
    return metrics


Metrics = Annotated[dict[str, MetricValue], BeforeValidator(_numbers_only)]


def _as_message_or_choice(item: Any) -> Any:
    # A dict that carries a `message` is a serialised Choice; any other dict is a message. An
    # `openai` Choice object (appended as ART's rollouts do) becomes ours, with its exact tokens.
    if isinstance(item, dict) and "message" in item and "role" not in item:
        return Choice.model_validate(item)
    if not isinstance(item, (dict, Choice)) and hasattr(item, "message") and hasattr(item, "finish_reason"):
        return Choice.from_openai_choice(item)
    return item


class History(StrictModel):
    """An extra conversation of a rollout: a sub-agent's calls, or a branch."""

    messages_and_choices: list[MessageOrChoice] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _parse_items(cls, items: Any) -> Any:
        return [_as_message_or_choice(i) for i in items] if isinstance(items, list) else items

    @field_serializer("messages_and_choices", mode="wrap")
    def _serialize_items(self, items: list[Any], handler: Any) -> Any:
        return handler(self._normalized())

    def _normalized(self) -> list[MessageOrChoice]:
        """The items, with any `openai` Choice appended after construction made ours, in place."""
        self.messages_and_choices[:] = [_as_message_or_choice(item) for item in self.messages_and_choices]
        return self.messages_and_choices

    def choices(self) -> list[Choice]:
        return [item for item in self._normalized() if isinstance(item, Choice)]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain OpenAI messages (choices become their assistant message)."""
        return [item.message if isinstance(item, Choice) else item for item in self._normalized()]


class Trajectory(History):
    reward: float = 0.0
    metrics: Metrics = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    additional_histories: list[History] = Field(default_factory=list)
    # ART's: the newest step when the rollout started and ended (PipelineTrainer sets them; its staleness bound reads them)
    initial_policy_version: PolicyVersion | None = None
    final_policy_version: PolicyVersion | None = None

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


def rewards_differ(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards carry a learning signal: two or more that are not all equal. GRPO
    skips a group without (the backend), and the pipeline drops it before it takes a batch's place."""
    return len(rewards) >= 2 and max(rewards) - min(rewards) >= 1e-9


class TrajectoryGroup(StrictModel):
    """Rollouts of one scenario, compared with each other to compute advantages.

    As in ART, `TrajectoryGroup(rollout(scenario) for _ in range(8))` (awaitables, not started)
    is a pending group for `gather_trajectory_groups`, or to await on its own; from finished
    trajectories (and exceptions, kept as tracebacks) it is a group at once."""

    trajectories: list[Trajectory] = Field(default_factory=list)
    exceptions: list[str] = Field(default_factory=list)  # tracebacks of rollouts that failed
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def __new__(cls, trajectories: Iterable[Any] | None = None, /, **fields: Any) -> Any:
        if trajectories is None:
            return super().__new__(cls)
        items = list(trajectories)
        if items and all(inspect.isawaitable(item) for item in items):
            return PendingGroup(items, fields)
        group = super().__new__(cls)
        done = [item for item in items if isinstance(item, Trajectory)]
        failed = [item for item in items if isinstance(item, BaseException)]
        strange = [item for item in items if not isinstance(item, (Trajectory, BaseException))]
        if strange:
            raise TypeError(
                f"TrajectoryGroup takes Trajectory objects and exceptions, or awaitables of rollouts (all of them), "
                f"not {type(strange[0]).__name__}. To run rollouts, pass them not started: "
                "TrajectoryGroup(rollout(scenario) for _ in range(n)).")
        if "trajectories" in fields:
            raise TypeError("pass the trajectories once: positionally or as trajectories=, not both")
        fields["exceptions"] = [*fields.get("exceptions", []), *failed]
        BaseModel.__init__(group, trajectories=done, **fields)
        return group

    def __init__(self, trajectories: Iterable[Any] | None = None, /, **fields: Any) -> None:
        if trajectories is None:  # built in __new__ when given positionally
            super().__init__(**fields)

    @field_validator("exceptions", mode="before")
    @classmethod
    def _tracebacks(cls, exceptions: Any) -> Any:
        """An exception object becomes its traceback, ART's stored {type, message, traceback} too."""
        if not isinstance(exceptions, list):
            return exceptions
        return [_traceback_text(item) for item in exceptions]

    def __iter__(self) -> Any:  # type: ignore[override]  # ART's groups iterate over their trajectories
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)


class NotATrajectoryError(TypeError):
    """A rollout returned something else than a Trajectory: one failed rollout."""

    @classmethod
    def of(cls, value: Any) -> NotATrajectoryError:
        return cls(f"a rollout returned {type(value).__name__}, not a Trajectory: end it with "
                   "`return trajectory` (a Trajectory with its reward set)")


def _traceback_text(item: Any) -> Any:
    if isinstance(item, BaseException):
        return "".join(traceback.format_exception(item))
    if isinstance(item, dict) and set(item) == {"type", "message", "traceback"}:
        return item["traceback"] or f"{item['type']}: {item['message']}"
    return item


class PendingGroup:
    """A group of rollouts not run yet: ART's `TrajectoryGroup(awaitables)`. Awaited on its own it
    runs them all and keeps each failure in the group's `exceptions`; `gather_trajectory_groups`
    runs them with its concurrency limit, progress bar and `max_exceptions`."""

    def __init__(self, rollouts: list[Awaitable[Any]], fields: dict[str, Any]) -> None:
        self.rollouts = rollouts
        self.fields = fields

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        async def run() -> TrajectoryGroup:
            results = await asyncio.gather(*self.rollouts, return_exceptions=True)
            for result in results:
                if isinstance(result, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                    raise result
            return TrajectoryGroup([result if isinstance(result, (Trajectory, BaseException)) else
                                    NotATrajectoryError.of(result) for result in results], **self.fields)

        return run().__await__()
