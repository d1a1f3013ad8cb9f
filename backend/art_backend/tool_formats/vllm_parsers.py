"""vLLM's own tool-call and reasoning parsers (`--tool-call-parser`, `--reasoning-parser`) reading
replies on the vLLM engine, so that it answers as `vllm serve` would. Our formats still write the
prompt, the forced-call grammar and the stream's hold-back; where vLLM's parser of a name does not
take the model's tokenizer (its Llama parser wants `<|python_tag|>` in the vocabulary, say), ours
reads the replies and the log says why."""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from art_backend.tool_formats.base import ParsedOutput, ParsedToolCall

if TYPE_CHECKING:
    from art_backend.chat_format import ChatFormatter

logger = logging.getLogger(__name__)

# where vLLM keeps them: current releases first, then 0.24's layout
_TOOL_PARSER_MODULES = ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers")
_REQUEST_MODULES = ("vllm.entrypoints.openai.chat_completion.protocol", "vllm.entrypoints.openai.protocol")


def _first(modules: Sequence[str], name: str) -> Any:
    for module in modules:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"{name} is in none of {', '.join(modules)}")


class _VLLMToolCalls:
    def __init__(self, formatter: ChatFormatter, parser: Any, request_type: Any) -> None:
        self._format = formatter.tool_format
        self._parser = parser
        self._request_type = request_type

    def __call__(self, text: str, tools: Sequence[dict]) -> ParsedOutput:
        request = self._request_type.model_validate(
            {"model": "-", "messages": [{"role": "user", "content": ""}], "tools": list(tools) or None})
        extracted = self._parser.extract_tool_calls(text, request)
        if not extracted.tools_called:
            unread = self._format.markup_start(text) is not None
            return ParsedOutput(text, [], f"tool call markup did not parse (vLLM's {self._format.name} parser read "
                                          "no call from it)" if unread else None)
        # ids in the family's own shape on both engines (vLLM's hermes parser names them chatcmpl-tool-...)
        calls = [ParsedToolCall(self._format.new_call_id(), call.function.name, call.function.arguments)
                 for call in extracted.tool_calls]
        content = extracted.content  # vLLM's keeps the space before a call; ours, and clients, have no use for it
        return ParsedOutput(content if content and content.strip() else None, calls, None)


class _VLLMReasoning:
    def __init__(self, parser: Any, request_type: Any) -> None:
        self._parser = parser
        self._request = request_type.model_validate({"model": "-", "messages": [{"role": "user", "content": ""}]})

    def __call__(self, text: str, opened: bool | None) -> tuple[str | None, str | None]:
        if opened is False:  # the prompt closed an empty block: thinking is off
            return None, text
        reasoning, content = self._parser.extract_reasoning(text, self._request)
        return reasoning, content


def use_vllm_parsers(formatter: ChatFormatter, tokenizer: Any) -> None:
    """Make `formatter` read replies with vLLM's parsers of its formats' names, where they load."""
    try:
        request_type = _first(_REQUEST_MODULES, "ChatCompletionRequest")
        tool_parsers = _first(_TOOL_PARSER_MODULES, "ToolParserManager")
        reasoning_parsers = _first(("vllm.reasoning",), "ReasoningParserManager")
    except ImportError as error:
        logger.warning("vLLM's parsers were not found (%s): replies are read with this backend's own.", error)
        return
    name = formatter.tool_call_parser
    try:
        formatter.parse_tool_calls = _VLLMToolCalls(
            formatter, tool_parsers.get_tool_parser(name)(tokenizer), request_type)
    except Exception as error:  # noqa: BLE001 - any refusal of vLLM's means: use ours, and say why
        logger.warning("vLLM's %r tool-call parser does not take this model's tokenizer (%s): tool calls are read "
                       "with this backend's own %r parser, which reads the same markup.", name, error, name)
    if formatter.reasoning_parser is not None:
        name = formatter.reasoning_parser
        try:
            formatter.split_reasoning = _VLLMReasoning(
                reasoning_parsers.get_reasoning_parser(name)(tokenizer), request_type)
        except Exception as error:  # noqa: BLE001 - as above
            logger.warning("vLLM's %r reasoning parser does not take this model's tokenizer (%s): reasoning is "
                           "read with this backend's own.", name, error)
