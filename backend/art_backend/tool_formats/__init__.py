"""Each model family's tool-call and reasoning markup, named as vLLM names its parsers
(`--tool-call-parser`, `--reasoning-parser`), and picked from the model's chat template unless named.

The torch engine parses with these modules; the vLLM engine with vLLM's own parsers of the same
names (`vllm_parsers.py`), where they take the model's tokenizer. Our own are kept small rather
than borrowed from transformers' response parsing, because the stream filter and the grammar
that forces a call need each family's markup spelled out anyway.
"""

from __future__ import annotations

from art_backend.tool_formats.base import (
    CallMarkup,
    ParsedOutput,
    ParsedToolCall,
    ToolCallFormat,
    new_tool_call_id,
)
from art_backend.tool_formats.hermes import HermesFormat
from art_backend.tool_formats.llama3_json import PYTHON_TAG, Llama3JsonFormat
from art_backend.tool_formats.mistral import TOOL_CALLS, MistralFormat
from art_backend.tool_formats.reasoning import ReasoningStream, ThinkReasoning

TOOL_CALL_PARSERS: dict[str, type[ToolCallFormat]] = {
    format_.name: format_ for format_ in (HermesFormat, Llama3JsonFormat, MistralFormat)
}
REASONING_PARSERS: dict[str, type[ThinkReasoning]] = {name: ThinkReasoning for name in ThinkReasoning.names}


class UnknownParserError(ValueError):
    pass


def _named(name: str, known: dict[str, type], setting: str) -> type:
    if name not in known:
        raise UnknownParserError(f"{setting}={name!r} is not a format this backend knows: use one of "
                                 f"{', '.join(sorted(known))}, or leave it unset to pick from the chat template.")
    return known[name]


def tool_call_parser_for(template: str, name: str | None = None) -> str:
    """vLLM's name for the tool-call markup a chat template writes (hermes where it writes none)."""
    if name is not None:
        return _named(name, TOOL_CALL_PARSERS, "tool_call_parser").name
    if TOOL_CALLS in template:
        return MistralFormat.name
    if PYTHON_TAG in template or ('"parameters": ' in template and "<|start_header_id|>" in template):
        return Llama3JsonFormat.name
    return HermesFormat.name


def reasoning_parser_for(template: str, name: str | None = None) -> str | None:
    """vLLM's name for the reasoning markup a chat template writes, or None."""
    if name is not None:
        _named(name, REASONING_PARSERS, "reasoning_parser")
        return name
    if ThinkReasoning.start in template and ThinkReasoning.end in template:
        # DeepSeek-R1's templates open the block in the generation prompt; Qwen3's let the model
        return "deepseek_r1" if "<｜Assistant｜><think>" in template else "qwen3"
    return None


__all__ = ["TOOL_CALL_PARSERS", "REASONING_PARSERS", "CallMarkup", "HermesFormat", "Llama3JsonFormat",
           "MistralFormat", "ParsedOutput", "ParsedToolCall", "ReasoningStream", "ThinkReasoning",
           "ToolCallFormat", "UnknownParserError", "new_tool_call_id", "reasoning_parser_for",
           "tool_call_parser_for"]
