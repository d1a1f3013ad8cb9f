"""OpenAI chat messages to prompt text/ids through the model's chat template, and replies back to
`content`, `reasoning_content` and `tool_calls` in the model family's own markup (`tool_formats/`).

Templates that handle `tools` themselves (Qwen2.5/3, Llama 3.x, Mistral) get the tools and tool
turns as-is and their family's markup is read back; for templates that don't (SmolLM2) the tools
block and tool turns are written into plain system/user/assistant turns in Hermes markup.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from art_backend.errors import ChatFormatError
from art_backend.grammar import tool_call_grammar
from art_backend.tool_formats import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ParsedOutput,
    ReasoningStream,
    ThinkReasoning,
    ToolCallFormat,
    reasoning_parser_for,
    tool_call_parser_for,
)
from art_backend.tool_formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOLS_INSTRUCTIONS, TOOLS_PREAMBLE

_ROLES = ("system", "developer", "user", "assistant", "tool")
_FUNCTION_SHAPE = "{'type': 'function', 'function': {'name': ..., ...}}"
# what the template is given by the server and transformers, never by a request's chat_template_kwargs
# (besides the tokenizer's special tokens: bos_token, eos_token, ...)
_RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message",
                                      "documents", "tokenize", "raise_exception", "strftime_now", "loop",
                                      "namespace", "range", "dict", "cycler", "joiner", "lipsum"})


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt text -> ids. The template already wrote any BOS; letting the tokenizer add one would double it."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def _dumps(value: Any) -> str:
    # Default separators match what models are shown and produce, so re-rendered turns round-trip.
    return json.dumps(value, ensure_ascii=False)


def _text_content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatFormatError(f"{where}.content must be a string, null or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(
                f"{where}.content has a part of type {kind!r}; only text parts are supported "
                "(images and other media are not)"
            )
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _role(message: Any, where: str) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in _ROLES:
        raise ChatFormatError(f"{where} has role {role!r}; expected one of {', '.join(_ROLES)}")
    return "system" if role == "developer" else role


def _call_arguments(call: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """The name, the arguments' JSON text as sent, and the decoded arguments of an OpenAI
    `tool_calls` entry."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"{where} must look like {_FUNCTION_SHAPE}, got {call!r}")
    raw = function.get("arguments") or "{}"
    text = raw if isinstance(raw, str) else _dumps(raw)
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatFormatError(
            f"{where}.function.arguments is not valid JSON ({exc}): {raw!r}"
        ) from None
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"{where}.function.arguments must encode a JSON object, got {raw!r}")
    return function["name"], text, arguments


def _arguments_as_rendered(text: str, arguments: dict[str, Any]) -> str:
    """A call's arguments as the prompt shows them: as the client sent them, so a reply passed
    back as it came renders as the model wrote it (token for token). LangChain instead sends
    `json.dumps(args)`, escaping every non-ASCII character: that spelling is put back to the
    one the model writes."""
    if text == json.dumps(arguments) and text != _dumps(arguments):
        return _dumps(arguments)
    return text


def _function_name(tool: Any) -> str:
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatFormatError(f"each tool must look like {_FUNCTION_SHAPE}, got {tool!r}")
    return function["name"]



@dataclass(frozen=True)
class Prompt:
    """A rendered prompt, and whether it left a reasoning block open (True), closed an empty one
    (False: thinking is off) or left it to the reply (None)."""

    text: str
    reasoning_opened: bool | None = None


# Readers of whole replies: ours, or vLLM's of the same names (see tool_formats/vllm_parsers.py).
# A tool-call parser gets the reply's text and the request's tools.
ToolCallParser = Callable[[str, Sequence[dict]], ParsedOutput]
ReasoningParser = Callable[[str, bool | None], tuple[str | None, str | None]]


class ChatFormatter:
    """Renders prompts with the model's chat template and reads replies in its family's markup.

    `tool_call_parser` and `reasoning_parser` take vLLM's names ("hermes", "llama3_json",
    "mistral"; "qwen3", "deepseek_r1"); None picks them from the chat template."""

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError("the tokenizer has no chat_template; use an instruct/chat model")
        self._tokenizer = tokenizer
        self._template = str(template)
        self.supports_tools_natively: bool = "tools" in self._template
        self.tool_call_parser = tool_call_parser_for(self._template, tool_call_parser)
        if not self.supports_tools_natively and self.tool_call_parser != "hermes":
            raise ChatFormatError(
                f"tool_call_parser={self.tool_call_parser!r}: this model's chat template renders no tools, so "
                "they are taught in Hermes markup (<tool_call>); leave tool_call_parser unset or use 'hermes'.")
        self.tool_format: ToolCallFormat = TOOL_CALL_PARSERS[self.tool_call_parser]()
        self.reasoning_parser = reasoning_parser_for(self._template, reasoning_parser)
        self.reasoning: ThinkReasoning | None = (
            REASONING_PARSERS[self.reasoning_parser]() if self.reasoning_parser else None)
        self._added_tokens: dict[str, int] = dict(tokenizer.get_added_vocab())
        self.parse_tool_calls: ToolCallParser = lambda text, tools: self.tool_format.parse(text)
        self.split_reasoning: ReasoningParser = self._split_reasoning

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        return self.render_prompt(messages, tools, tool_choice, template_kwargs).text

    def render_prompt(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> Prompt:
        self.required_tools(tools, tool_choice)  # validates tool_choice against tools
        kwargs = self._template_kwargs(template_kwargs or {})
        if self.supports_tools_natively:
            hf_messages = [self._native_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
            hf_messages = self.tool_format.prepare_messages(hf_messages)
            if tools:  # in OpenAI's shape, as vLLM passes them (Mistral's template reads `tool.function`)
                kwargs["tools"] = [{"type": "function", "function": tool.get("function", tool)} for tool in tools]
            text = self._apply_template(hf_messages, **kwargs)
        else:
            text = self._apply_template(self._hermes_messages(messages, tools), **kwargs)
        return Prompt(text, self.reasoning.opened_by(text) if self.reasoning else None)

    def render_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
    ) -> list[int]:
        return encode_prompt(self._tokenizer, self.render(messages, tools, tool_choice))

    @staticmethod
    def required_tools(tools: list[dict] | None, tool_choice: str | dict | None) -> list[dict] | None:
        """The tools the reply must call: None for "auto"/"none", all for "required", the named one."""
        if tool_choice in (None, "auto", "none"):
            return None
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        if tool_choice != "required" and (not isinstance(function, dict) or not isinstance(function.get("name"), str)):
            raise ChatFormatError(
                "tool_choice must be 'auto', 'none', 'required' or "
                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}"
            )
        if not tools:
            raise ChatFormatError(f"tool_choice {tool_choice!r} needs a non-empty `tools` list")
        if tool_choice == "required":
            return tools
        chosen = [tool for tool in tools if _function_name(tool) == function["name"]]
        if not chosen:
            raise ChatFormatError(f"tool_choice names {function['name']!r}, which is not in `tools`")
        return chosen

    def call_grammar(self, required: list[dict], parallel: bool, prompt: Prompt) -> str:
        """The grammar of a reply that calls `required` in this family's markup (after any
        reasoning the model writes first, as vLLM applies structure only once reasoning ends)."""
        reasoning = None
        if self.reasoning is not None and prompt.reasoning_opened is not False:
            reasoning = (self.reasoning.start, self.reasoning.end, prompt.reasoning_opened is True)
        return tool_call_grammar(required, parallel and self.tool_format.parallel_calls, self.tool_format.markup,
                                 self._added_tokens, reasoning)

    def parse(self, text: str, prompt: Prompt | None = None, tools: Sequence[dict] | None = ()) -> ParsedOutput:
        """A whole reply -> reasoning (where the family writes it), content and the calls of `tools`
        (None: a reply not read for calls)."""
        reasoning, content = self.split_reasoning(text, prompt.reasoning_opened if prompt else None)
        if content is None:  # cut off while reasoning
            return ParsedOutput(None, [], None, reasoning or None)
        parsed = self.parse_tool_calls(content, tools) if tools is not None else ParsedOutput(content, [], None)
        return ParsedOutput(parsed.content, parsed.tool_calls, parsed.parse_error, reasoning or None)

    def _split_reasoning(self, text: str, opened: bool | None) -> tuple[str | None, str | None]:
        return self.reasoning.split(text, opened) if self.reasoning is not None else (None, text)

    def _template_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A request's `chat_template_kwargs`, each one a name the template reads (else it would be
        ignored without a word)."""
        reserved = sorted((_RESERVED_TEMPLATE_NAMES | set(self._tokenizer.special_tokens_map)) & set(kwargs))
        if reserved:
            raise ChatFormatError(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server sets them "
                                  "from the request's own fields and the model's tokenizer.")
        unread = sorted(name for name in kwargs if not re.search(rf"\b{re.escape(name)}\b", self._template))
        if unread:
            raise ChatFormatError(f"chat_template_kwargs {', '.join(unread)}: this model's chat template reads no "
                                  "such name, so it would have no effect. Leave it out.")
        return dict(kwargs)

    def _apply_template(self, messages: list[dict], **kwargs: Any) -> str:
        try:
            return self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **kwargs
            )
        except jinja2.TemplateError as error:  # the template's own raise_exception, e.g. roles out of order
            raise ChatFormatError(f"The model's chat template refused these messages: {error}") from None
        except (TypeError, ValueError, AttributeError, KeyError) as error:  # e.g. a template argument of a type it
            # cannot use, or content it iterates: the request's doing, said as such rather than a 500
            raise ChatFormatError(f"The model's chat template failed on this request ({type(error).__name__}: "
                                  f"{error}); check chat_template_kwargs and the messages' shapes.") from None

    def _native_message(self, message: dict, where: str) -> dict:
        role = _role(message, where)
        out: dict[str, Any] = {"role": role, "content": _text_content(message.get("content"), where)}
        if role == "assistant":
            reasoning = message.get("reasoning_content", message.get("reasoning"))
            if isinstance(reasoning, str):
                out["reasoning_content"] = reasoning
            if message.get("tool_calls"):
                out["tool_calls"] = []
                for j, call in enumerate(message["tool_calls"]):
                    name, _, arguments = _call_arguments(call, f"{where}.tool_calls[{j}]")
                    hf_call = {"type": "function", "function": {"name": name, "arguments": arguments}}
                    out["tool_calls"].append({"id": call["id"], **hf_call} if call.get("id") else hf_call)
        if role == "tool" and message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        return out

    def _hermes_messages(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        out: list[dict] = []
        after_tool = False
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            role = _role(message, where)
            content = _text_content(message.get("content"), where)
            if role == "assistant" and message.get("tool_calls"):
                calls = []
                for j, call in enumerate(message["tool_calls"]):
                    name, text, arguments = _call_arguments(call, f"{where}.tool_calls[{j}]")
                    body = f'{{"name": {_dumps(name)}, "arguments": {_arguments_as_rendered(text, arguments)}}}'
                    calls.append(f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
                content = "\n".join([content, *calls] if content else calls)
            if role == "tool":
                response = f"<tool_response>\n{content}\n</tool_response>"
                if after_tool:
                    out[-1]["content"] += "\n" + response
                else:
                    out.append({"role": "user", "content": response})
            else:
                out.append({"role": role, "content": content})
            after_tool = role == "tool"
        if tools:
            block = TOOLS_PREAMBLE + "\n".join(map(_dumps, tools)) + TOOLS_INSTRUCTIONS
            # A system message of our own also keeps the template's default system prompt out.
            if out and out[0]["role"] == "system":
                system = out[0]["content"]
                out[0]["content"] = f"{system}\n\n{block}" if system else block
            else:
                out.insert(0, {"role": "system", "content": block})
        return out


class ReplyStream:
    """Feeds a streamed reply's text; returns the reasoning and content that are safe to send now,
    holding back call markup (and what could begin it) until `finish` parses it."""

    def __init__(self, formatter: ChatFormatter, prompt: Prompt, tools: Sequence[dict] | None) -> None:
        self._formatter = formatter
        self._reasoning = ReasoningStream(formatter.reasoning, prompt.reasoning_opened) if formatter.reasoning else None
        self._tools = tools
        self._text = ""
        self._emitted = 0
        self._in_markup = False

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        reasoning, delta = self._reasoning.feed(delta) if self._reasoning else ("", delta)
        return reasoning, self._content(delta)

    def _content(self, delta: str) -> str:
        self._text += delta
        if self._tools is None:
            safe, self._emitted = self._text[self._emitted:], len(self._text)
            return safe
        if self._in_markup:
            return ""
        tool_format = self._formatter.tool_format
        start = tool_format.markup_start(self._text)
        self._in_markup = start is not None
        end = start if start is not None else len(self._text) - tool_format.held_suffix(self._text)
        # Trailing whitespace waits too: parse() strips it from content before a tool call.
        safe = self._text[self._emitted:end].rstrip()
        self._emitted += len(safe)
        return safe

    def finish(self) -> ParsedOutput:
        """What was held back, parsed: its reasoning, content and calls."""
        reasoning, delta = self._reasoning.finish() if self._reasoning else ("", "")
        self._content(delta)
        held = self._text[self._emitted:]
        if self._tools is None:
            return ParsedOutput(held or None, [], None, reasoning or None)
        parsed = (self._formatter.parse_tool_calls(held, self._tools) if held.strip()
                  else ParsedOutput(held or None, [], None))
        return ParsedOutput(parsed.content or None, parsed.tool_calls, parsed.parse_error, reasoning or None)
