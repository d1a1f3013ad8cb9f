"""The observations of one trajectory's Langfuse trace: a generation per model turn, a tool span
per tool call, a span per additional history (sub-agent or branch); and the trace's tags and
metadata. Used by `langfuse.LangfuseExporter` inside the trace's root observation."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from art_integrations.trajectory import Choice, History

if TYPE_CHECKING:
    from langfuse._client.span import LangfuseObservationWrapper

_ATTRIBUTE_LIMIT = 200  # Langfuse drops a tag or propagated metadata value longer than this


@dataclass(frozen=True)
class TraceLabels:
    """Where a group of rollouts belongs. `step`: the policy step that generated them."""

    project: str
    model: str
    step: int
    split: str = "train"

    @property
    def served_model(self) -> str:
        return f"{self.model}@{self.step}"


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= _ATTRIBUTE_LIMIT - 20 else text[:_ATTRIBUTE_LIMIT - 23] + "..."


def trace_attributes(labels: TraceLabels, scenario: Any, group_index: int,
                     index: int) -> tuple[list[str], dict[str, Any]]:
    """Tags and trace metadata: what a step's group is filtered by in Langfuse."""
    metadata: dict[str, Any] = {"project": _short(labels.project), "model": _short(labels.model), "step": labels.step,
                                "split": _short(labels.split), "group": group_index, "trajectory": index}
    tags = [f"project:{labels.project}", f"model:{labels.model}", f"step:{labels.step}", f"split:{labels.split}"]
    if scenario is not None:
        metadata["scenario"] = _short(scenario)
        tags.append(f"scenario:{scenario}")
    return [_short(tag) for tag in tags], metadata


def _message(item: Choice | dict[str, Any]) -> dict[str, Any]:
    return item.message if isinstance(item, Choice) else item


def opening(history: History) -> list[dict[str, Any]] | None:
    """The messages before the first model turn: the task as the agent got it."""
    messages: list[dict[str, Any]] = []
    for item in history.messages_and_choices:
        if isinstance(item, Choice) or item.get("role") == "assistant":
            break
        messages.append(item)
    return messages or None


def closing(history: History) -> dict[str, Any] | None:
    return _message(history.messages_and_choices[-1]) if history.messages_and_choices else None


def _tool_names(history: History) -> list[str]:
    return [str(tool.get("function", tool).get("name")) for tool in history.tools or []]


def _usage(choice: Choice) -> dict[str, int] | None:
    usage: dict[str, int] = {}
    if choice.prompt_token_ids is not None:
        usage["input"] = len(choice.prompt_token_ids)
    if choice.token_ids is not None:
        usage["output"] = len(choice.token_ids)
    if len(usage) == 2:
        usage["total"] = usage["input"] + usage["output"]
    return usage or None


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:  # the model's own text, kept as it was
        return arguments


def add_history(parent: LangfuseObservationWrapper, history: History, labels: TraceLabels) -> None:
    """One generation per model turn, each followed by its tool calls, under `parent`."""
    items = history.messages_and_choices
    results = {m.get("tool_call_id"): m for m in map(_message, items) if m.get("role") == "tool"}
    tools = _tool_names(history)
    turn = 0
    for position, item in enumerate(items):
        if not isinstance(item, Choice):
            continue
        turn += 1
        logprobs = item.token_logprobs
        metadata: dict[str, Any] = {"turn": turn, "finish_reason": item.finish_reason, "tools": tools,
                                    "exact_tokens": item.token_ids is not None}
        if logprobs:
            metadata["mean_logprob"] = statistics.fmean(logprobs)
        parent.start_observation(
            name="model call", as_type="generation", model=labels.served_model,
            input=[_message(i) for i in items[:position]], output=item.message,
            usage_details=_usage(item), metadata=metadata).end()
        for call in item.message.get("tool_calls") or []:
            _add_tool_call(parent, call, results.get(call.get("id")))


def _add_tool_call(parent: LangfuseObservationWrapper, call: dict[str, Any], result: dict[str, Any] | None) -> None:
    name = str(call.get("function", {}).get("name") or "tool")
    if result is None:  # the rollout ended (or failed) before the tool answered
        parent.start_observation(name=name, as_type="tool", input=_arguments(call),
                                 metadata={"tool_call_id": call.get("id")}, level="WARNING",
                                 status_message="no tool result in the trajectory").end()
        return
    parent.start_observation(name=name, as_type="tool", input=_arguments(call), output=result.get("content"),
                             metadata={"tool_call_id": call.get("id")}).end()


def add_sub_history(root: LangfuseObservationWrapper, history: History, labels: TraceLabels,
                    agent: str | None, number: int) -> None:
    """An additional history under its own span: a sub-agent's name, or `branch` for a
    conversation of the main agent that did not continue the main one."""
    if agent and agent != "main":
        name, kind, as_type = agent, "sub-agent", "agent"
    else:
        name, kind, as_type = ("branch" if agent == "main" else f"history {number + 1}"), "branch", "chain"
    span = root.start_observation(name=name, as_type=as_type, input=opening(history),
                                  metadata={"kind": kind, "additional_history": number})
    add_history(span, history, labels)
    span.update(output=closing(history)).end()
