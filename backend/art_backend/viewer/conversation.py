"""A stored conversation (a trajectory or one of its additional histories) as turns to show:
who spoke, what was said, the tool calls with their arguments, and which call each tool
result answers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from art_integrations.trajectory import Choice, History


@dataclass(frozen=True)
class ToolCallShown:
    name: str
    arguments: str  # pretty-printed when it is JSON, as sent otherwise
    call_id: str | None


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    tool_calls: list[ToolCallShown] = field(default_factory=list)
    answers_call: str | None = None  # a tool result: the name of the call it answers
    model_turn: bool = False  # produced by the policy (a Choice): its tokens are trained on
    finish_reason: str | None = None
    completion_tokens: int | None = None


@dataclass(frozen=True)
class Conversation:
    turns: list[Turn]
    tool_names: list[str]  # the tools offered to the model

    @property
    def model_turns(self) -> int:
        return sum(turn.model_turn for turn in self.turns)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text kept, other kinds named
        return "\n".join(str(part.get("text", f"[{part.get('type', 'part')}]")) if isinstance(part, dict) else str(part)
                         for part in content)
    return json.dumps(content, ensure_ascii=False)


def _arguments(raw: Any) -> str:
    if isinstance(raw, str):
        try:
            return json.dumps(json.loads(raw), indent=2, ensure_ascii=False)
        except json.JSONDecodeError:
            return raw  # what the model wrote, even when it is not JSON
    return json.dumps(raw, indent=2, ensure_ascii=False)


def _tool_calls(message: dict[str, Any]) -> list[ToolCallShown]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        calls.append(ToolCallShown(str(function.get("name", "?")), _arguments(function.get("arguments", "")),
                                   call.get("id") if isinstance(call, dict) else None))
    return calls


def conversation(history: History) -> Conversation:
    turns: list[Turn] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, to label the results
    for item in history.messages_and_choices:
        message = item.message if isinstance(item, Choice) else item
        calls = _tool_calls(message)
        call_names.update({call.call_id: call.name for call in calls if call.call_id})
        role = str(message.get("role", "?"))
        answers = None
        if role == "tool":
            call_id = message.get("tool_call_id")
            answers = message.get("name") or call_names.get(str(call_id)) or (str(call_id) if call_id else None)
        turns.append(Turn(
            role=role, content=_text(message.get("content")), tool_calls=calls, answers_call=answers,
            model_turn=isinstance(item, Choice),
            finish_reason=item.finish_reason if isinstance(item, Choice) else None,
            completion_tokens=len(item.token_ids) if isinstance(item, Choice) and item.token_ids is not None else None))
    tool_names = [str(tool.get("function", tool).get("name", "?")) for tool in history.tools or []
                  if isinstance(tool, dict)]
    return Conversation(turns, tool_names)
