"""A generation request and its reply, read into the `ModelCall`s a trajectory is made of, the same
whichever HTTP client carried them.

A chat completion is recorded as the conversation it was (each of its choices, when it asked for
n > 1, a history of its own); a Responses call as its items turned
into chat messages; a text completion (`/v1/completions`) as a single-turn history, the prompt a
user message, each choice a call of its own. Each comes with its exact tokens and logprobs where
the reply carries them all (a backend asked with the token-logprobs header); otherwise with its
token record id, and the capture fetches its tokens at exit.
"""

from __future__ import annotations

import json
from typing import Any

from art_integrations.capture.scope import ModelCall
from art_integrations.capture.tokens import exact_choice
from art_integrations.responses_items import chat_tool, input_messages, output_message

CHAT, RESPONSES, COMPLETIONS = "/chat/completions", "/responses", "/completions"


def events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream (`[DONE]` left out)."""
    found = []
    for block in body.decode().replace("\r\n", "\n").split("\n\n"):
        data = "\n".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
        if data and data != "[DONE]":
            found.append(json.loads(data))
    return found


def calls_from_reply(kind: str, sent: dict[str, Any], body: bytes, event_stream: bool, endpoint: str,
                     api_key: str | None) -> list[ModelCall] | None:
    """The calls that request body `sent` and its reply `body` were; None for a stream cut short."""
    if kind == RESPONSES:
        call = _responses_call(sent, body, event_stream, endpoint, api_key)
        return None if call is None else [call]
    if kind == COMPLETIONS:
        return _completion_calls(sent, body, event_stream, endpoint, api_key)
    choices = _streamed_choices(events(body)) if event_stream else _whole_choices(json.loads(body))
    if choices is None:
        return None
    calls = []
    for index, choice in sorted(choices.items()):  # n > 1: each sample a call of its own, so a history of its own
        message = {key: value for key, value in choice["message"].items() if key != "id" and value is not None}
        call = ModelCall(endpoint=endpoint, api_key=api_key, record_id=choice["message"].get("id"),
                         messages=sent["messages"], response=message, finish_reason=choice.get("finish_reason"),
                         tools=sent.get("tools"), via_transport=True, metadata={"choice": index} if index else {})
        calls.append(with_tokens(call, choice))
    return calls


def with_tokens(call: ModelCall, reply: dict[str, Any]) -> ModelCall:
    """`call` with its exact tokens where `reply` (a choice or a Response) carries them all; else it
    waits for the capture's token fetch (the first call to a backend, or one from before the header).
    The logprobs are the backend's `token_logprobs`, or, where the request asked for OpenAI's
    `logprobs` (ChatART does), the same values in `logprobs.content`, one entry per token."""
    logprobs = reply.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    token_logprobs = reply.get("token_logprobs")
    if token_logprobs is None and content is not None and len(content) == len(reply.get("token_ids") or ()):
        token_logprobs = [entry["logprob"] for entry in content]
    tokens = [reply.get("prompt_token_ids"), reply.get("token_ids"), token_logprobs]
    if all(part is not None for part in tokens):
        call.choice = exact_choice(call, *tokens)  # type: ignore[arg-type]
    return call


def _responses_call(sent: dict[str, Any], body: bytes, event_stream: bool, endpoint: str,
                    api_key: str | None) -> ModelCall | None:
    if event_stream:
        ends = [e["response"] for e in events(body) if e.get("type") in ("response.completed",
                                                                          "response.incomplete")]
        if not ends:
            return None
        answer = ends[-1]
    else:
        answer = json.loads(body)
    message = output_message(answer["output"])
    finish = "length" if answer.get("status") == "incomplete" else "tool_calls" if message.get("tool_calls") \
        else "stop"
    call = ModelCall(endpoint=endpoint, api_key=api_key, record_id=answer.get("token_record_id"),
                     messages=input_messages(sent["input"], sent.get("instructions")), response=message,
                     finish_reason=finish, tools=[chat_tool(t) for t in sent.get("tools") or []] or None,
                     via_transport=True)
    return with_tokens(call, answer)


def _whole_choices(completion: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {choice.get("index", i): {"prompt_token_ids": completion.get("prompt_token_ids"), **choice}
            for i, choice in enumerate(completion["choices"])}


def _streamed_choices(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]] | None:
    """Each choice of a streamed chat completion, whole, as a non-streamed one has it; None if one
    did not finish (the stream was cut short)."""
    prompt_ids = None
    parts: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
        for choice in chunk.get("choices") or []:
            parts.setdefault(choice.get("index", 0), []).append(choice)
    choices = {index: _joined(deltas, prompt_ids) for index, deltas in parts.items()}
    if not choices or any(choice["finish_reason"] is None for choice in choices.values()):
        return None
    return choices


def _joined(deltas: list[dict[str, Any]], prompt_ids: list[int] | None) -> dict[str, Any]:
    """One choice's stream deltas, joined into its message, finish reason and tokens."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    tokens: dict[str, Any] = {"prompt_token_ids": prompt_ids, "token_ids": [], "token_logprobs": []}
    content: list[dict[str, Any]] = []  # OpenAI's logprobs, where the request asked for them
    for choice in deltas:
        tokens["token_ids"] += choice.get("token_ids") or []
        tokens["token_logprobs"] += choice.get("token_logprobs") or []
        content += (choice.get("logprobs") or {}).get("content") or []
        delta = choice.get("delta") or {}
        message["content"] += delta.get("content") or ""
        if delta.get("id"):
            message["id"] = delta["id"]
        for call in delta.get("tool_calls") or []:
            whole = calls.setdefault(call.get("index", len(calls)), {"id": None, "type": "function",
                                                                      "function": {"name": "", "arguments": ""}})
            whole["id"] = call.get("id") or whole["id"]
            function = call.get("function") or {}
            whole["function"]["name"] += function.get("name") or ""
            whole["function"]["arguments"] += function.get("arguments") or ""
        finish = choice.get("finish_reason") or finish
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    if len(tokens["token_logprobs"]) != len(tokens["token_ids"]):
        tokens["token_logprobs"] = None  # a reply without them: read from `logprobs`, or fetched by the capture
    return {"message": message, "finish_reason": finish, "logprobs": {"content": content}, **tokens}


def _prompt_text(prompt: Any) -> str:
    """A text completion's prompt as the user message's text (a prompt of token ids has none here:
    its exact ids are the choice's `prompt_token_ids`)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


def _completion_calls(sent: dict[str, Any], body: bytes, event_stream: bool, endpoint: str,
                      api_key: str | None) -> list[ModelCall] | None:
    """Each choice of a text completion, a call of its own on the same single-message prompt."""
    choices: dict[int, dict[str, Any]] = {}
    prompt_ids = None
    if event_stream:
        for chunk in events(body):
            prompt_ids = chunk.get("prompt_token_ids", prompt_ids)
            for part in chunk.get("choices") or []:
                whole = choices.setdefault(part.get("index", 0), {"text": "", "token_ids": [], "token_logprobs": [],
                                                                  "finish_reason": None, "token_record_id": None})
                whole["text"] += part.get("text") or ""
                whole["token_ids"] += part.get("token_ids") or []
                whole["token_logprobs"] += part.get("token_logprobs") or []
                whole["finish_reason"] = part.get("finish_reason") or whole["finish_reason"]
                whole["token_record_id"] = part.get("token_record_id") or whole["token_record_id"]
                whole["prompt_token_ids"] = part.get("prompt_token_ids", whole.get("prompt_token_ids"))
        if not choices or any(c["finish_reason"] is None for c in choices.values()):
            return None
        for whole in choices.values():
            if len(whole["token_logprobs"]) != len(whole["token_ids"]):
                whole["token_logprobs"] = None
    else:
        completion = json.loads(body)
        prompt_ids = completion.get("prompt_token_ids")
        choices = {choice.get("index", i): choice for i, choice in enumerate(completion["choices"])}
    messages = [{"role": "user", "content": _prompt_text(sent.get("prompt"))}]
    calls = []
    for index in sorted(choices):
        choice = {"prompt_token_ids": prompt_ids, **{k: v for k, v in choices[index].items() if v is not None}}
        call = ModelCall(endpoint=endpoint, api_key=api_key, record_id=choice.get("token_record_id"),
                         messages=messages, response={"role": "assistant", "content": choice.get("text") or ""},
                         finish_reason=choice.get("finish_reason"), via_transport=True,
                         metadata={"endpoint": "completions", "choice": index})
        calls.append(with_tokens(call, choice))
    return calls
