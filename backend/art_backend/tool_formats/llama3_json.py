"""Llama 3.1, 3.2 and 3.3 (JSON calls): the reply is the call itself,
`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, then end of turn. The
models' templates render one call per assistant turn, with `parameters` (vLLM's llama3_json)."""

from __future__ import annotations

from typing import ClassVar

from art_backend.tool_formats.base import (
    CallMarkup,
    ParsedOutput,
    ToolCallFormat,
    parse_call_object,
    skip_space,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonFormat(ToolCallFormat):
    name: ClassVar[str] = "llama3_json"
    markup: ClassVar[CallMarkup] = CallMarkup(arguments_key="parameters")
    parallel_calls: ClassVar[bool] = False  # "This model only supports single tool-calls at once!"

    def parse(self, text: str) -> ParsedOutput:
        start = self.markup_start(text)
        if start is None:
            return ParsedOutput(text, [], None)
        position = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
        calls = []
        try:
            while True:  # calls separated by ";", as vLLM's parser reads them
                call, position = parse_call_object(text, self.new_call_id(), position)
                calls.append(call)
                position = skip_space(text, position)
                if not text.startswith(";", position):
                    break
                position += 1
            if text[position:].strip():
                raise ValueError("text after the call")
        except ValueError as error:
            return ParsedOutput(text, [], f"tool call {len(calls) + 1} did not parse: {error}")
        return ParsedOutput(None, calls, None)

    def markup_start(self, text: str) -> int | None:
        start = skip_space(text, 0)
        return start if text.startswith(("{", PYTHON_TAG), start) else None

    def held_suffix(self, text: str) -> int:
        # only a reply's start can open a call: hold back leading space, or what could begin the tag
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return len(text)
        return 0
