"""The capture's adapter for requests: hand-written agents' `requests.post(...)` loops.

Every request of requests (the module functions, a `Session`, an adapter mounted on one) passes
through `Session.send`, so that is wrapped. A whole reply is read inside `send` already; a
streamed one (`stream=True`, read with `iter_lines`/`iter_content`) is teed at `response.raw`,
the urllib3 response those read from, and recorded when it is exhausted or closed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from art_integrations.capture.scope import current_capture
from art_integrations.capture.transports.core import Collected, Exchange, begin, json_body
from art_integrations.wire import BACKEND_HEADER, TOKEN_LOGPROBS_HEADER
from art_integrations.capture.transports.patching import handling, wrap_method


class RawTee(Collected):
    """A urllib3 response that collects the bytes read from it; anything else is the original's."""

    def __init__(self, raw: Any, done: Callable[[bytes], None]) -> None:
        super().__init__(done)
        self._raw = raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        for part in self._raw.stream(*args, **kwargs):
            self.parts += part
            yield part
        self.finish()

    def read(self, *args: Any, **kwargs: Any) -> bytes:
        data = self._raw.read(*args, **kwargs)
        self.parts += data
        amount = args[0] if args else kwargs.get("amt")
        if not data or amount is None:
            self.finish()
        return data

    def close(self) -> None:
        self._raw.close()
        self.finish()


def _observe(exchange: Exchange, response: Any, streamed: bool) -> None:
    if not exchange.answered(response.status_code, BACKEND_HEADER in response.headers):
        return
    content_type = response.headers.get("content-type", "")
    if streamed:
        response.raw = RawTee(response.raw, lambda body: exchange.record(body, content_type))
    else:
        exchange.record(response.content, content_type)


def _send(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        scope = current_capture()
        if scope is None:  # outside a capture: this read is all it costs
            return original(self, request, **kwargs)
        with handling() as new:
            headers = request.headers
            exchange = begin(scope, request.method or "", request.url or "", headers.get("authorization"),
                             json_body(request.body)) if new else None
            if exchange is None:
                return original(self, request, **kwargs)
            if exchange.ask_tokens:
                headers[TOKEN_LOGPROBS_HEADER] = "1"
            response = original(self, request, **kwargs)
            _observe(exchange, response, streamed=bool(kwargs.get("stream", self.stream)))
            return response

    return send


def install(module: ModuleType) -> None:
    """Wrap `requests.Session.send`, once (see patching.py)."""
    wrap_method(module.Session, "send", _send)
