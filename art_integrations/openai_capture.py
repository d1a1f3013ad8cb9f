"""Capture at the transport: every request the `openai` SDK sends to an art-backend inside
`art_capture()` is recorded, whatever framework or client made it, with no handler or wrapper.

The first capture replaces `httpx.Client.send` and `httpx.AsyncClient.send` (what every openai
SDK client, sync or async, sends through) once for the process. Outside a capture the patched
send costs one context-variable read. Inside one, a request is looked at only when the openai
SDK sent it (its `X-Stainless-Lang` header) to a chat-completions or Responses path, and is
recorded only when the answer carries the backend's `X-Art-Backend` header: a judge on another
server, or a tool's own API, passes through untouched. A whole reply is read where the SDK reads
it; a streamed one is read as the SDK consumes it, and recorded when its last event has passed.

A call is recorded as the chat conversation it was (a Responses call's items as chat messages)
with its exact tokens and logprobs, read from the reply itself: the request goes out with the
`X-Art-Token-Logprobs` header, at which a backend puts each token's logprob beside its id (any
other server ignores it), so no second request is made for them. ChatART records its calls with
their tokens itself and marks its requests (`X-Art-Recorded-By`): the transport leaves those
alone. A call that a callback handler (ARTLLM's included) records as well is kept once:
`capture.assemble` drops the transport's copy of a call recorded under the same token record id,
and gives its tokens to the handler's call, which saw only the call's id.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx

from art_integrations.capture import CaptureScope, ModelCall, current_capture, exact_choice
from art_integrations.responses_items import chat_tool, input_messages, output_message

BACKEND_HEADER = "x-art-backend"  # on every generated answer of an art-backend
SDK_HEADER = "x-stainless-lang"  # on every request the openai SDK sends
TOKEN_LOGPROBS_HEADER = "x-art-token-logprobs"  # asks a backend for each token's logprob beside its id
# on the requests of an integration that records its calls with their tokens itself (ChatART): passed by untouched
RECORDED_BY_HEADER = "X-Art-Recorded-By"
CHAT, RESPONSES = "/chat/completions", "/responses"

# httpx's own sends, called by the patched ones
ORIGINAL_SEND = httpx.Client.send
ORIGINAL_ASYNC_SEND = httpx.AsyncClient.send


def install() -> None:
    """Patch httpx's sends, once per process (idempotent)."""
    if httpx.Client.send is not _send:
        httpx.Client.send = _send  # type: ignore[method-assign]
    if httpx.AsyncClient.send is not _async_send:
        httpx.AsyncClient.send = _async_send  # type: ignore[method-assign]


def _kind(request: httpx.Request) -> str | None:
    """CHAT or RESPONSES for a generation request the openai SDK sends; None for any other."""
    if request.method != "POST" or SDK_HEADER not in request.headers or RECORDED_BY_HEADER in request.headers:
        return None
    path = request.url.path.rstrip("/")
    return CHAT if path.endswith(CHAT) else RESPONSES if path.endswith(RESPONSES) else None


def _send(self: httpx.Client, request: httpx.Request, **kwargs: Any) -> httpx.Response:
    scope = current_capture()
    kind = _kind(request) if scope is not None else None
    if kind is not None:
        request.headers[TOKEN_LOGPROBS_HEADER] = "1"
    response = ORIGINAL_SEND(self, request, **kwargs)
    if kind is not None and scope is not None:
        _observe(scope, kind, request, response, streamed=bool(kwargs.get("stream")))
    return response


async def _async_send(self: httpx.AsyncClient, request: httpx.Request, **kwargs: Any) -> httpx.Response:
    scope = current_capture()
    kind = _kind(request) if scope is not None else None
    if kind is not None:
        request.headers[TOKEN_LOGPROBS_HEADER] = "1"
    response = await ORIGINAL_ASYNC_SEND(self, request, **kwargs)
    if kind is not None and scope is not None:
        _observe(scope, kind, request, response, streamed=bool(kwargs.get("stream")))
    return response


def _observe(scope: CaptureScope, kind: str, request: httpx.Request, response: httpx.Response, streamed: bool) -> None:
    if response.status_code != 200 or BACKEND_HEADER not in response.headers:
        return  # another server's answer, or an error the SDK raises to the rollout itself

    def record(body: bytes) -> None:
        try:
            call = _call(kind, request, body, event_stream="text/event-stream" in response.headers.get(
                "content-type", ""))
        except (ValueError, KeyError, TypeError) as error:
            scope.error(f"a reply from {request.url} could not be read for the trajectory: {error!r}")
            return
        if call is None:
            scope.error(f"a streamed reply from {request.url} was closed before its end, so it is not recorded: "
                        "read the whole stream inside the capture")
        elif call.record_id is None:  # an integration that records the call says so too: named if nothing else is
            scope.note_unrecorded(f"{call.endpoint} without token ids",
                                  "leave return_token_ids on (the backend's default) rather than sending false")
        else:
            scope.add(call)

    if not streamed:
        record(response.content)
    elif isinstance(response.stream, httpx.AsyncByteStream):
        response.stream = _AsyncTee(response.stream, record)
    else:
        response.stream = _Tee(response.stream, record)  # type: ignore[arg-type]


class _Collected:
    """The bytes a stream has handed on so far, given whole to `done` once, at its end or close."""

    def __init__(self, done: Callable[[bytes], None]) -> None:
        self.done, self.parts, self.finished = done, bytearray(), False

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.done(bytes(self.parts))


class _Tee(_Collected, httpx.SyncByteStream):
    def __init__(self, stream: httpx.SyncByteStream, done: Callable[[bytes], None]) -> None:
        super().__init__(done)
        self.stream = stream

    def __iter__(self) -> Iterator[bytes]:
        for part in self.stream:
            self.parts += part
            yield part
        self.finish()

    def close(self) -> None:
        self.stream.close()
        self.finish()


class _AsyncTee(_Collected, httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, done: Callable[[bytes], None]) -> None:
        super().__init__(done)
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self.stream:
            self.parts += part
            yield part
        self.finish()

    async def aclose(self) -> None:
        await self.stream.aclose()
        self.finish()


def _events(body: bytes) -> list[dict[str, Any]]:
    """The JSON events of a server-sent event stream (chat's `[DONE]` left out)."""
    events = []
    for block in body.decode().split("\n\n"):
        data = "\n".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
        if data and data != "[DONE]":
            events.append(json.loads(data))
    return events


def _endpoint(request: httpx.Request, kind: str) -> tuple[str, str | None]:
    url = str(request.url).partition("?")[0].rstrip("/")  # not url.copy_with: 50 us a call
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    return url.removesuffix(kind), key.strip() if scheme.lower() == "bearer" else None


def _call(kind: str, request: httpx.Request, body: bytes, event_stream: bool) -> ModelCall | None:
    """The call that `request` and its answer `body` were; None for a stream cut short."""
    sent = json.loads(request.content)
    endpoint, api_key = _endpoint(request, kind)
    if kind == RESPONSES:
        if event_stream:
            ends = [e["response"] for e in _events(body) if e.get("type") in ("response.completed",
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
        return _with_tokens(call, answer)
    if event_stream:
        choice = _streamed_choice(_events(body))
    else:
        completion = json.loads(body)
        choice = {"prompt_token_ids": completion.get("prompt_token_ids"), **completion["choices"][0]}
    if choice is None:
        return None
    message = {key: value for key, value in choice["message"].items() if key != "id" and value is not None}
    call = ModelCall(endpoint=endpoint, api_key=api_key, record_id=choice["message"].get("id"),
                     messages=sent["messages"], response=message, finish_reason=choice.get("finish_reason"),
                     tools=sent.get("tools"), via_transport=True)
    return _with_tokens(call, choice)


def _with_tokens(call: ModelCall, reply: dict[str, Any]) -> ModelCall:
    """`call` with its exact tokens where `reply` (a choice or a Response) carries them all; else it
    waits for the capture's token fetch (a backend from before the token-logprobs header)."""
    tokens = [reply.get(key) for key in ("prompt_token_ids", "token_ids", "token_logprobs")]
    if all(part is not None for part in tokens):
        call.choice = exact_choice(call, *tokens)  # type: ignore[arg-type]
    return call


def _streamed_choice(chunks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first choice of a streamed chat completion, whole, as a non-streamed one has it."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    tokens: dict[str, Any] = {"prompt_token_ids": None, "token_ids": [], "token_logprobs": []}
    for chunk in chunks:
        tokens["prompt_token_ids"] = chunk.get("prompt_token_ids", tokens["prompt_token_ids"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            tokens["token_ids"] += choice.get("token_ids") or []
            tokens["token_logprobs"] += choice.get("token_logprobs") or []
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
    if finish is None:
        return None
    if calls:
        message["tool_calls"] = [calls[index] for index in sorted(calls)]
    if len(tokens["token_logprobs"]) != len(tokens["token_ids"]):
        tokens["token_logprobs"] = None  # a backend that sent no logprobs: the capture fetches them
    return {"message": message, "finish_reason": finish, **tokens}
