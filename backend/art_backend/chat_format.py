"""OpenAI chat messages to prompt text/ids, and the model's tool-call markup back to `tool_calls`.

Tool calls use the Hermes/Qwen markup: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
Templates that handle `tools` themselves (Qwen2.5/3) get the tools as-is; for templates that
don't (SmolLM2) the tools block and tool turns are written into plain system/user/assistant turns.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_ROLES = ("system", "developer", "user", "assistant", "tool")
_ID_ALPHABET = string.ascii_letters + string.digits
_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
_TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
_FUNCTION_SHAPE = "{'type': 'function', 'function': {'name': ..., ...}}"


class ChatFormatError(ValueError):
    """A request's messages, tools or tool_choice cannot be rendered."""


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


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Prompt text -> ids. The template already wrote any BOS; letting the tokenizer add one would double it."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def new_tool_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


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


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


_JSON = json.JSONDecoder()
_STRICT_JSON = json.JSONDecoder(parse_constant=_not_json)  # no NaN or Infinity: strict clients refuse them
_SPACE = re.compile(r"[ \t\n\r]*")


def _member_texts(text: str) -> dict[str, str]:
    """The members of the JSON object `text`, each value as the JSON text it was written as
    (the standard decoder tells where a value ends, not where it starts)."""
    position = _SPACE.match(text).end()  # type: ignore[union-attr]
    if text[position:position + 1] != "{":
        raise ValueError("expected a JSON object")
    members: dict[str, str] = {}
    position = _SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
    closed = text[position:position + 1] == "}"
    while not closed:
        key, position = _STRICT_JSON.raw_decode(text, position)
        position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
        if not isinstance(key, str) or text[position:position + 1] != ":":
            raise ValueError("expected a string key and a colon")
        start = _SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
        _, position = _STRICT_JSON.raw_decode(text, start)
        members[key] = text[start:position]
        position = _SPACE.match(text, position).end()  # type: ignore[union-attr]
        separator = text[position:position + 1]
        if separator not in (",", "}"):
            raise ValueError("expected a comma or the end of the object")
        closed = separator == "}"
        position = _SPACE.match(text, position + 1).end()  # type: ignore[union-attr]
    if position != len(text):
        raise ValueError("text after the JSON object")
    return members


def _parse_call_body(body: str) -> ParsedToolCall:
    """A call as the model wrote it: its arguments keep their exact JSON text (a number such as
    69E25 stays so; re-encoding would spell it 6.9e+26 and the next prompt would no longer
    repeat the model's tokens)."""
    try:
        members = _member_texts(body)
        name = json.loads(members.get("name", "null"))
    except json.JSONDecodeError as error:
        raise ValueError(str(error)) from None
    if not isinstance(name, str) or not name:
        raise ValueError('expected {"name": "...", "arguments": {...}}')
    arguments = members.get("arguments", members.get("parameters", "{}"))
    value = _STRICT_JSON.decode(arguments)
    if isinstance(value, str):  # arguments written as a string of JSON
        arguments, value = value, _STRICT_JSON.decode(value)
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got {type(value).__name__}")
    return ParsedToolCall(new_tool_call_id(), name, arguments)


def _call_block(text: str, body_start: int) -> tuple[str, int]:
    """The body of the tool-call block opening at `body_start`, and where the block ends.

    The body is read as JSON first, so a "</tool_call>" inside a string argument does not end
    it; a body that is not JSON ends at the first close tag (and then fails to parse, flagged).
    An unclosed last block is normal: generation stops at end-of-turn after the JSON."""
    json_start = len(text) - len(text[body_start:].lstrip())
    try:
        _, json_end = _JSON.raw_decode(text, json_start)
    except json.JSONDecodeError:
        json_end = -1
    if json_end != -1:
        after = text[json_end:].lstrip()
        if after.startswith(TOOL_CALL_CLOSE):
            return text[body_start:json_end], len(text) - len(after) + len(TOOL_CALL_CLOSE)
        if not after:
            return text[body_start:json_end], len(text)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    return (text[body_start:], len(text)) if end == -1 else (text[body_start:end], end + len(TOOL_CALL_CLOSE))


class ChatFormatter:
    def __init__(self, tokenizer: Any) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ChatFormatError("the tokenizer has no chat_template; use an instruct/chat model")
        self._tokenizer = tokenizer
        self.supports_tools_natively: bool = "tools" in str(template)

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
    ) -> str:
        self.required_tools(tools, tool_choice)  # validates tool_choice against tools
        if self.supports_tools_natively:
            hf_messages = [self._native_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
            hf_tools = [tool.get("function", tool) for tool in tools] if tools else None
            return self._apply_template(hf_messages, tools=hf_tools)
        return self._apply_template(self._hermes_messages(messages, tools))

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

    def parse(self, text: str) -> ParsedOutput:
        outside: list[str] = []
        calls: list[ParsedToolCall] = []
        pos = 0
        while (start := text.find(TOOL_CALL_OPEN, pos)) != -1:
            outside.append(text[pos:start])
            body, pos = _call_block(text, start + len(TOOL_CALL_OPEN))
            try:
                calls.append(_parse_call_body(body))
            except ValueError as exc:
                return ParsedOutput(text, [], f"tool call {len(calls) + 1} did not parse: {exc}")
        if not calls:
            return ParsedOutput(text, [], None)
        outside.append(text[pos:])
        return ParsedOutput("".join(outside).strip() or None, calls, None)

    def _apply_template(self, messages: list[dict], **kwargs: Any) -> str:
        return self._tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )

    def _native_message(self, message: dict, where: str) -> dict:
        role = _role(message, where)
        out: dict[str, Any] = {"role": role, "content": _text_content(message.get("content"), where)}
        if role == "assistant" and message.get("tool_calls"):
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
            block = _TOOLS_PREAMBLE + "\n".join(map(_dumps, tools)) + _TOOLS_INSTRUCTIONS
            # A system message of our own also keeps the template's default system prompt out.
            if out and out[0]["role"] == "system":
                system = out[0]["content"]
                out[0]["content"] = f"{system}\n\n{block}" if system else block
            else:
                out.insert(0, {"role": "system", "content": block})
        return out


def _partial_open_len(text: str) -> int:
    """Length of the longest suffix of `text` that could be the start of TOOL_CALL_OPEN."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_OPEN[:size]):
            return size
    return 0


class ToolCallStreamFilter:
    """Feeds streamed completion text; returns the part that is safe to emit as `content` now,
    holding back anything from the first "<tool_call>" (or a suffix that could start it, e.g. "<tool").
    """

    def __init__(self, formatter: ChatFormatter) -> None:
        self._formatter = formatter
        self._text = ""
        self._emitted = 0
        self._in_markup = False

    def feed(self, delta: str) -> str:
        self._text += delta
        if self._in_markup:
            return ""
        start = self._text.find(TOOL_CALL_OPEN, self._emitted)
        self._in_markup = start != -1
        end = start if self._in_markup else len(self._text) - _partial_open_len(self._text)
        # Trailing whitespace waits too: parse() strips it from content before a tool call.
        safe = self._text[self._emitted : end].rstrip()
        self._emitted += len(safe)
        return safe

    def finish(self) -> ParsedOutput:
        # What feed() emitted holds no markup, so parsing the held-back tail finds the same calls.
        parsed = self._formatter.parse(self._text[self._emitted :])
        return ParsedOutput(parsed.content or None, parsed.tool_calls, parsed.parse_error)
