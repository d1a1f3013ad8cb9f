"""Hermes markup (Qwen2.5, Qwen3, Hermes, and the default for templates without tools, e.g. SmolLM2):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call."""

from __future__ import annotations

from typing import ClassVar

from art_backend.tool_formats.base import (
    JSON,
    CallMarkup,
    ParsedOutput,
    ParsedToolCall,
    ToolCallFormat,
    parse_call_object,
    partial_suffix,
    skip_space,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# The prompt that teaches the markup to a model whose template has no tools of its own (the
# words of Qwen2.5's template, which Hermes-trained models know).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _call_block(text: str, body_start: int) -> tuple[str, int]:
    """The body of the tool-call block opening at `body_start`, and where the block ends.

    The body is read as JSON first, so a "</tool_call>" inside a string argument does not end
    it; a body that is not JSON ends at the first close tag (and then fails to parse, flagged).
    An unclosed last block is normal: generation stops at end-of-turn after the JSON."""
    json_start = skip_space(text, body_start)
    try:
        _, json_end = JSON.raw_decode(text, json_start)
    except ValueError:
        json_end = -1
    if json_end != -1:
        after = text[json_end:].lstrip()
        if after.startswith(TOOL_CALL_CLOSE):
            return text[body_start:json_end], len(text) - len(after) + len(TOOL_CALL_CLOSE)
        if not after:
            return text[body_start:json_end], len(text)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    return (text[body_start:], len(text)) if end == -1 else (text[body_start:end], end + len(TOOL_CALL_CLOSE))


class HermesFormat(ToolCallFormat):
    name: ClassVar[str] = "hermes"
    markup: ClassVar[CallMarkup] = CallMarkup(open=TOOL_CALL_OPEN + "\n", close="\n" + TOOL_CALL_CLOSE,
                                              between="\n")

    def parse(self, text: str) -> ParsedOutput:
        outside: list[str] = []
        calls: list[ParsedToolCall] = []
        position = 0
        while (start := text.find(TOOL_CALL_OPEN, position)) != -1:
            outside.append(text[position:start])
            body, position = _call_block(text, start + len(TOOL_CALL_OPEN))
            try:
                call, end = parse_call_object(body, self.new_call_id())
                if body[end:].strip():
                    raise ValueError("text after the JSON object")
            except ValueError as error:
                return ParsedOutput(text, [], f"tool call {len(calls) + 1} did not parse: {error}")
            calls.append(call)
        if not calls:
            return ParsedOutput(text, [], None)
        outside.append(text[position:])
        return ParsedOutput("".join(outside).strip() or None, calls, None)

    def markup_start(self, text: str) -> int | None:
        start = text.find(TOOL_CALL_OPEN)
        return None if start == -1 else start

    def held_suffix(self, text: str) -> int:
        return partial_suffix(text, TOOL_CALL_OPEN)
