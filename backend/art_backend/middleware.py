"""The ASGI middlewares that keep every answer OpenAI-shaped where Starlette's own would not be:
a body over the size limit, and an unexpected error (answered without closing the connection).

Plain ASGI, not `BaseHTTPMiddleware`: each needs the raw channel, `receive` to count a body as it
arrives, `send` to know whether a response is already under way.
"""

from __future__ import annotations

import logging

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from art_backend.errors import error_body

logger = logging.getLogger(__name__)


class BodyLimit:
    """Refuse a request body over `max_bytes`: a 413 from the HTTP exception handler, OpenAI-shaped
    (Starlette's RequestBodyLimitMiddleware would answer in plain text)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        received = int(declared) if declared.isdigit() else 0  # a declared size is refused before it is read

        async def counted() -> Message:
            nonlocal received
            if received > self.max_bytes:
                raise HTTPException(413)
            message = await receive()
            if message["type"] == "http.request" and not declared.isdigit():
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, counted, send)


class UnexpectedErrorsAnswered:
    """An unexpected error becomes an OpenAI-shaped 500 here, and goes no further. Starlette's
    outermost error middleware answers too, but then re-raises, and uvicorn closes the kept-alive
    connection under the client's next request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        answered = False

        async def send_noting_start(message: Message) -> None:
            nonlocal answered
            answered = answered or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_noting_start)
        except Exception as error:
            if answered:  # a response under way cannot turn into another: only closing is left
                raise
            logger.exception("Request failed")
            response = JSONResponse(error_body(f"{type(error).__name__}: {error}", "InternalServerError", None, 500),
                                    status_code=500)
            await response(scope, receive, send)

