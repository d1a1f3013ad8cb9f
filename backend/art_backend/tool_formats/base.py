"""What every family's tool-call format shares: parsed output, a call's JSON as the model wrote it,
call ids, and the interface each family's module fills in."""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ParsedToolCall]
    parse_error: str | None
    reasoning: str | None = None


@dataclass(frozen=True)
class CallMarkup:
    """How a family writes one or more calls around each call's JSON object, for the grammar that
    forces a call: `before` + call + (`between` + call)* + `after`, each call `open` + JSON + `close`."""

    arguments_key: str = "arguments"
    before: str = ""
    open: str = ""
    close: str = ""
    between: str = ""
    after: str = ""


def random_id(length: int) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def new_tool_call_id() -> str:
    return "call_" + random_id(24)


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


JSON = json.JSONDecoder()
STRICT_JSON = json.JSONDecoder(parse_constant=_not_json)  # no NaN or Infinity: strict clients refuse them
_SPACE = re.compile(r"[ \t\n\r]*")


def skip_space(text: str, position: int) -> int:
    return _SPACE.match(text, position).end()  # type: ignore[union-attr]


def member_texts(text: str, position: int = 0) -> tuple[dict[str, str], int]:
    """The members of the JSON object starting at `position` (after any space), each value as the
    JSON text it was written as (the standard decoder tells where a value ends, not where it
    starts), and where the object ends."""
    position = skip_space(text, position)
    if text[position:position + 1] != "{":
        raise ValueError("expected a JSON object")
    members: dict[str, str] = {}
    position = skip_space(text, position + 1)
    closed = text[position:position + 1] == "}"
    if closed:
        position += 1
    while not closed:
        key, position = STRICT_JSON.raw_decode(text, position)
        position = skip_space(text, position)
        if not isinstance(key, str) or text[position:position + 1] != ":":
            raise ValueError("expected a string key and a colon")
        start = skip_space(text, position + 1)
        _, position = STRICT_JSON.raw_decode(text, start)
        members[key] = text[start:position]
        position = skip_space(text, position)
        separator = text[position:position + 1]
        if separator not in (",", "}"):
            raise ValueError("expected a comma or the end of the object")
        closed = separator == "}"
        position = position + 1 if closed else skip_space(text, position + 1)
    return members, position


def parse_call_object(text: str, call_id: str, position: int = 0) -> tuple[ParsedToolCall, int]:
    """A call written as `{"name": ..., "arguments" (or "parameters"): {...}}` from `position`, and
    where it ends. Its arguments keep their exact JSON text (a number such as 69E25 stays so;
    re-encoding would spell it 6.9e+26 and the next prompt would no longer repeat the model's tokens)."""
    try:
        members, end = member_texts(text, position)
        name = json.loads(members.get("name", "null"))
    except json.JSONDecodeError as error:
        raise ValueError(str(error)) from None
    if not isinstance(name, str) or not name:
        raise ValueError('expected {"name": "...", "arguments": {...}}')
    arguments = members.get("arguments", members.get("parameters", "{}"))
    value = STRICT_JSON.decode(arguments)
    if isinstance(value, str):  # arguments written as a string of JSON
        arguments, value = value, STRICT_JSON.decode(value)
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
    return ParsedToolCall(call_id, name, arguments), end


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could be the start of `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ToolCallFormat(ABC):
    """One family's tool-call markup: how replies are parsed, where a call starts (so a stream
    holds it back), and how a forced call is written (`markup`, for the grammar)."""

    name: ClassVar[str]  # vLLM's --tool-call-parser name for the same markup
    markup: ClassVar[CallMarkup]
    # the markup opens with a special token, which detokenizing with skip_special_tokens would drop
    keeps_special_tokens: ClassVar[bool] = False
    # the family's template renders more than one call per assistant turn
    parallel_calls: ClassVar[bool] = True

    def new_call_id(self) -> str:
        return new_tool_call_id()

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as the family's template needs them (OpenAI shape, arguments decoded)."""
        return messages

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """A whole reply -> its text content and calls; markup that does not parse stays text,
        with `parse_error` saying why."""

    @abstractmethod
    def markup_start(self, text: str) -> int | None:
        """Where call markup begins in `text` (a reply so far), or None."""

    @abstractmethod
    def held_suffix(self, text: str) -> int:
        """How many characters at the end of `text` could be the beginning of call markup."""
