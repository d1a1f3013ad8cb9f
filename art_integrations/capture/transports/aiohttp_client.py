"""The capture's adapter for aiohttp: async agents that post to the backend themselves.

Every request of a `ClientSession` (`post`, `request`, `ws_connect` aside) passes through
`ClientSession._request`, so that is wrapped. aiohttp never reads a reply's body before handing
the response over, so the response's `content` (the stream that `read`, `json`, `text` and line
iteration all read from) is replaced by a reader that collects what passes through it and
records the reply once it has been read to its end.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from types import ModuleType
from typing import Any

from art_integrations.capture.scope import current_capture
from art_integrations.capture.transports.core import Collected, Exchange, begin, json_body
from art_integrations.wire import BACKEND_HEADER, TOKEN_LOGPROBS_HEADER
from art_integrations.capture.transports.patching import handling, wrap_method


class ContentTee(Collected):
    """An aiohttp `StreamReader` that collects the bytes read from it; anything else is the original's."""

    def __init__(self, content: Any, done: Callable[[bytes], None]) -> None:
        super().__init__(done)
        self._content = content

    def __getattr__(self, name: str) -> Any:
        return getattr(self._content, name)

    def _took(self, data: bytes) -> bytes:
        self.parts += data
        if self._content.at_eof():
            self.finish()
        return data

    async def read(self, n: int = -1) -> bytes:
        return self._took(await self._content.read(n))

    async def readany(self) -> bytes:
        return self._took(await self._content.readany())

    async def readline(self, **kwargs: Any) -> bytes:
        return self._took(await self._content.readline(**kwargs))

    async def readuntil(self, *args: Any, **kwargs: Any) -> bytes:
        return self._took(await self._content.readuntil(*args, **kwargs))

    async def readexactly(self, n: int) -> bytes:
        return self._took(await self._content.readexactly(n))

    async def readchunk(self) -> tuple[bytes, bool]:
        data, end_of_chunk = await self._content.readchunk()
        return self._took(data), end_of_chunk

    def read_nowait(self, n: int = -1) -> bytes:
        return self._took(self._content.read_nowait(n))

    async def _lines(self, read: Callable[[], Awaitable[bytes]]) -> AsyncIterator[bytes]:
        while True:
            part = await read()
            if not part:
                return
            yield part

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._lines(self.readline)

    def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        self._content.set_read_chunk_size(n)
        return self._lines(lambda: self.read(n))

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._lines(self.readany)

    async def iter_chunks(self) -> AsyncIterator[tuple[bytes, bool]]:
        while True:
            chunk = await self.readchunk()
            if chunk == (b"", False):
                return
            yield chunk


def _sent(data: Any, sent_json: Any) -> Callable[[], Any]:
    if sent_json is not None:
        return lambda: sent_json
    return json_body(data if isinstance(data, (bytes, str)) else None)


def _request(original: Callable[..., Any], multidict: Any) -> Callable[..., Any]:
    @functools.wraps(original)
    async def request(self: Any, method: str, str_or_url: Any, **kwargs: Any) -> Any:
        scope = current_capture()
        if scope is None:  # outside a capture: this read is all it costs
            return await original(self, method, str_or_url, **kwargs)
        if method.upper() != "POST":  # before merging headers: most requests end here
            return await original(self, method, str_or_url, **kwargs)
        with handling() as new:
            headers = multidict.CIMultiDict(self.headers)
            headers.update(multidict.CIMultiDict(kwargs.get("headers") or {}))
            url = str(self._build_url(str_or_url) if hasattr(self, "_build_url") else str_or_url)
            exchange = begin(scope, method, url, headers.get("authorization"),
                             _sent(kwargs.get("data"), kwargs.get("json"))) if new else None
            if exchange is None:
                return await original(self, method, str_or_url, **kwargs)
            if exchange.ask_tokens:
                asked = multidict.CIMultiDict(kwargs.get("headers") or {})
                asked[TOKEN_LOGPROBS_HEADER] = "1"
                kwargs["headers"] = asked
            response = await original(self, method, str_or_url, **kwargs)
            _observe(exchange, response)
            return response

    return request


def _observe(exchange: Exchange, response: Any) -> None:
    if not exchange.answered(response.status, BACKEND_HEADER in response.headers):
        return
    content_type = response.headers.get("content-type", "")
    response.content = ContentTee(response.content, lambda body: exchange.record(body, content_type))


def install(module: ModuleType) -> None:
    """Wrap `aiohttp.ClientSession._request`, once (see patching.py)."""
    import multidict

    wrap_method(module.ClientSession, "_request", lambda original: _request(original, multidict))

