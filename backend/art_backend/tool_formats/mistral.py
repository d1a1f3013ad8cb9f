"""Mistral (7B v0.3, Nemo, Small): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, where
`[TOOL_CALLS]` is a special token. The templates render each call with an `"id"` of exactly 9
letters and digits (and refuse any other), so calls get such ids, and ids of other shapes sent by
clients are shortened to their last 9 letters and digits, as vLLM does."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from art_backend.tool_formats.base import (
    CallMarkup,
    ParsedOutput,
    ToolCallFormat,
    parse_call_object,
    partial_suffix,
    random_id,
    skip_space,
)

TOOL_CALLS = "[TOOL_CALLS]"
_ID = re.compile(r"[A-Za-z0-9]{9}")
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")


def mistral_call_id(call_id: str) -> str:
    if _ID.fullmatch(call_id):
        return call_id
    return _NOT_ALNUM.sub("", call_id)[-9:].rjust(9, "0")


class MistralFormat(ToolCallFormat):
    name: ClassVar[str] = "mistral"
    markup: ClassVar[CallMarkup] = CallMarkup(before=TOOL_CALLS + "[", between=", ", after="]")
    keeps_special_tokens: ClassVar[bool] = True

    def new_call_id(self) -> str:
        return random_id(9)

    def prepare_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        prepared = []
        for message in messages:
            message = dict(message)
            if message.get("tool_calls"):
                message["tool_calls"] = [{**call, "id": mistral_call_id(call.get("id") or self.new_call_id())}
                                         for call in message["tool_calls"]]
            if message.get("tool_call_id"):
                message["tool_call_id"] = mistral_call_id(message["tool_call_id"])
            prepared.append(message)
        return prepared

    def parse(self, text: str) -> ParsedOutput:
        start = self.markup_start(text)
        if start is None:
            return ParsedOutput(text, [], None)
        position = skip_space(text, start + len(TOOL_CALLS))
        calls = []
        try:
            if not text.startswith("[", position):
                raise ValueError(f"expected a JSON list after {TOOL_CALLS}")
            position = skip_space(text, position + 1)
            while not text.startswith("]", position):
                call, position = parse_call_object(text, self.new_call_id(), position)
                calls.append(call)
                position = skip_space(text, position)
                if text.startswith(",", position):
                    position = skip_space(text, position + 1)
                elif not text.startswith("]", position):
                    raise ValueError("expected a comma or the end of the list")
            if text[position + 1:].strip():
                raise ValueError("text after the list of calls")
        except ValueError as error:
            return ParsedOutput(text, [], f"tool call {len(calls) + 1} did not parse: {error}")
        return ParsedOutput(text[:start].strip() or None, calls, None)

    def markup_start(self, text: str) -> int | None:
        start = text.find(TOOL_CALLS)
        return None if start == -1 else start

    def held_suffix(self, text: str) -> int:
        return partial_suffix(text, TOOL_CALLS)
