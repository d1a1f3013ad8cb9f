"""OpenAI Responses API items as chat messages, and back: shared by the backend, which serves
`/v1/responses` through its chat-completions path, and the capture, which records a Responses
call as the chat conversation it was.

An input item list becomes chat messages: `instructions` a system message first, a message item
its role and text, consecutive `function_call` items the `tool_calls` of one assistant message
(joined to the assistant message right before them, as the Responses API splits one reply into
a message item and its calls), a `function_call_output` a tool message, and a `reasoning` item
the `reasoning_content` of the assistant message that follows it.
"""

from __future__ import annotations

from typing import Any

# content parts that carry text, and the field that holds it
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal",
               "summary_text": "text", "reasoning_text": "text"}


class UnsupportedItemError(ValueError):
    """An input item or content part that has no chat-message counterpart here."""


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UnsupportedItemError(f"{where}: content must be a string or a list of parts, not "
                                   f"{type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise UnsupportedItemError(f"{where}.content[{index}] is of type {kind!r}: only text parts "
                                       f"({', '.join(sorted(_TEXT_PARTS))}) are served; send images and files as text")
        text = part.get(_TEXT_PARTS[kind]) or ""
        if not isinstance(text, str):
            raise UnsupportedItemError(f"{where}.content[{index}].{_TEXT_PARTS[kind]} must be a string")
        texts.append(text)
    return "".join(texts)


def input_messages(items: str | list[dict[str, Any]], instructions: str | None = None) -> list[dict[str, Any]]:
    """The chat messages that Responses `input` (and `instructions`) stand for."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    reasoning: str | None = None  # a reasoning item waits for the assistant message it belongs to

    def assistant(joinable: bool) -> dict[str, Any]:
        nonlocal reasoning
        last = messages[-1] if messages else None
        if joinable and last is not None and last["role"] == "assistant" and reasoning is None:
            return last
        message: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning is not None:
            message["reasoning_content"], reasoning = reasoning, None
        messages.append(message)
        return message

    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            assistant(joinable=False)["content"] = _text(item.get("content"), where)
        elif kind == "message":
            messages.append({"role": item.get("role"), "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            message = assistant(joinable=True)
            message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(output, where) if output is not None else ""})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text(parts, where)
        else:
            raise UnsupportedItemError(f"{where} is of type {kind!r}, which this server does not take: send the "
                                       "conversation itself (messages, function_call and function_call_output items)")
    return messages


def output_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that a response's `output` items stand for (as `input_messages`
    reads them when they are sent back in the next turn's input)."""
    return next((m for m in input_messages(output) if m["role"] == "assistant"), {"role": "assistant", "content": None})


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (`name`, `parameters` at its top) in the chat shape (under `function`)."""
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}
