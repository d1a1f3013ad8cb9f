"""Our trajectories in the JSON OpenPipe ART's pydantic models load (0.5.x), for the other way
round there is nothing to convert: `TrajectoryGroup.model_validate(art_json)` reads ART's JSON
(its exceptions, policy versions and group metrics kept, "token_id:N" logprobs read as token ids,
a field we do not know refused by name).

Where the shapes differ, `to_art` makes ours ART's:
- each model turn becomes an OpenAI choice whose logprobs spell the tokens "token_id:N" (vLLM's
  `return_tokens_as_token_ids`, what ART's tokenizer reads), `token_ids` and `prompt_token_ids`
  kept beside them;
- metadata values other than ART's scalars (str, int, float, bool, None) become JSON strings;
- exceptions (tracebacks here) become ART's {type, message, traceback};
- a turn without a finish reason (captured from a stream that ended without one) says "stop".
"""

from __future__ import annotations

import json
from typing import Any

from art_integrations.trajectory import Choice, History, Trajectory, TrajectoryGroup

_SCALARS = (str, int, float, bool, type(None))


def to_art(group: TrajectoryGroup) -> dict[str, Any]:
    """`group` as ART's TrajectoryGroup JSON (see the module's notes)."""
    return {
        "trajectories": [_trajectory(t) for t in group.trajectories],
        "exceptions": [_exception(text) for text in group.exceptions],
        "metadata": _metadata(group.metadata),
        "metrics": dict(group.metrics),
        "logs": list(group.logs),
    }


def _trajectory(trajectory: Trajectory) -> dict[str, Any]:
    return {
        **_history(trajectory),
        "additional_histories": [_history(h) for h in trajectory.additional_histories],
        "reward": trajectory.reward,
        "initial_policy_version": trajectory.initial_policy_version,
        "final_policy_version": trajectory.final_policy_version,
        "metrics": dict(trajectory.metrics),
        "metadata": _metadata(trajectory.metadata),
        "logs": list(trajectory.logs),
    }


def _history(history: History) -> dict[str, Any]:
    return {"messages_and_choices": [_choice(item) if isinstance(item, Choice) else item
                                     for item in history.messages_and_choices],
            "tools": history.tools}


def _choice(choice: Choice) -> dict[str, Any]:
    out = choice.model_dump(mode="json", exclude_none=True)
    out["message"] = {"role": "assistant", **choice.message}
    out["index"] = choice.index
    out["finish_reason"] = choice.finish_reason or "stop"  # ART validates an OpenAI choice: it must have one
    logprobs = choice.token_logprobs
    if choice.token_ids is not None and logprobs is not None and len(logprobs) == len(choice.token_ids):
        out["logprobs"] = {"content": [{"token": f"token_id:{token_id}", "logprob": logprob, "bytes": None,
                                        "top_logprobs": []} for token_id, logprob in zip(choice.token_ids, logprobs)],
                           "refusal": None}
    else:
        out["logprobs"] = None
    return out


def _metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    return {key: value if isinstance(value, _SCALARS) else json.dumps(value) for key, value in metadata.items()}


def _exception(traceback_text: str) -> dict[str, str]:
    last = traceback_text.strip().splitlines()[-1] if traceback_text.strip() else ""
    kind, _, message = last.partition(": ")
    return {"type": kind, "message": message, "traceback": traceback_text}
