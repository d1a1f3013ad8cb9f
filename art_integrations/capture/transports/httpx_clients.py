"""The capture's adapter for httpx and httpx2 (one API: httpx2 is the fork the openai SDK 3.x sends
through, 2.x sends through httpx), sync and async.

`Client.send` and `AsyncClient.send` are what every request of these clients passes through
(`post`, `stream`, the openai SDK, LiteLLM's httpx handlers), so those two are wrapped. A whole
reply (sent without `stream=True`) is read where the client read it; a streamed one is teed as its
reader consumes it, and recorded when its last byte has passed.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Iterator
from types import ModuleType
from typing import Any

from art_integrations.capture.scope import CaptureScope, current_capture
from art_integrations.capture.transports.core import Collected, Exchange, begin, json_body
from art_integrations.wire import BACKEND_HEADER, TOKEN_LOGPROBS_HEADER
from art_integrations.capture.transports.patching import handling, wrap_method


def _begin(scope: CaptureScope, request: Any) -> Exchange | None:
    if request.method != "POST":  # before building the URL's text
        return None
    return begin(scope, request.method, str(request.url), request.headers.get("authorization"),
                 lambda: json_body(request.content)())


def _tee_types(module: ModuleType) -> tuple[type, type]:
    """Byte streams of `module` (httpx or httpx2) that hand on a reply's bytes and collect them."""

    class Tee(Collected, module.SyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any, done: Callable[[bytes], None]) -> None:
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

    class AsyncTee(Collected, module.AsyncByteStream):  # type: ignore[name-defined,misc]
        def __init__(self, stream: Any, done: Callable[[bytes], None]) -> None:
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

    return Tee, AsyncTee


def _observe(exchange: Exchange, response: Any, tee: type) -> None:
    """Record `response` now if it was read whole, else as its stream is read."""
    headers = response.headers
    if not exchange.answered(response.status_code, BACKEND_HEADER in headers):
        return  # another server's answer, or an error the client raises to the rollout itself
    content_type = headers.get("content-type", "")
    if response.is_stream_consumed:
        exchange.record(response.content, content_type)
    else:
        response.stream = tee(response.stream, lambda body: exchange.record(body, content_type))


def _sync_send(original: Callable[..., Any], tee: type) -> Callable[..., Any]:
    @functools.wraps(original)
    def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        scope = current_capture()
        if scope is None:  # outside a capture: this read is all it costs
            return original(self, request, *args, **kwargs)
        with handling() as new:
            exchange = _begin(scope, request) if new else None
            if exchange is None:
                return original(self, request, *args, **kwargs)
            if exchange.ask_tokens:
                request.headers[TOKEN_LOGPROBS_HEADER] = "1"
            response = original(self, request, *args, **kwargs)
            _observe(exchange, response, tee)
            return response

    return send


def _async_send(original: Callable[..., Any], tee: type) -> Callable[..., Any]:
    @functools.wraps(original)
    async def send(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        scope = current_capture()
        if scope is None:
            return await original(self, request, *args, **kwargs)
        with handling() as new:
            exchange = _begin(scope, request) if new else None
            if exchange is None:
                return await original(self, request, *args, **kwargs)
            if exchange.ask_tokens:
                request.headers[TOKEN_LOGPROBS_HEADER] = "1"
            response = await original(self, request, *args, **kwargs)
            _observe(exchange, response, tee)
            return response

    return send


_tees: dict[str, tuple[type, type]] = {}


def install(module: ModuleType) -> None:
    """Wrap `module`'s (httpx's or httpx2's) client sends, once (see patching.py)."""
    if module.__name__ not in _tees:
        _tees[module.__name__] = _tee_types(module)
    tee, async_tee = _tees[module.__name__]
    wrap_method(module.Client, "send", lambda original: _sync_send(original, tee))
    wrap_method(module.AsyncClient, "send", lambda original: _async_send(original, async_tee))
