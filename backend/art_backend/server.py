"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI): the routes, and the exception
handlers that answer a refused request in OpenAI's error shape.

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/responses (served
through the chat path: `responses.py`), POST /v1/completions (text completions: `completions.py`),
POST /v1/art/token_records (`token_records.py`). Their answers carry the `X-Art-Backend` header, by
which the client's capture knows a backend's reply from any other server's. What a completion
holds is the chat service's (`chat_service.py`); this module only wires it to HTTP.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from art_backend import completions
from art_backend.chat_service import ChatService
from art_backend.continuation import DEFAULT_BUDGET_BYTES
from art_backend.engine.base import Engine
from art_backend.errors import ServiceError, error_body
from art_backend.middleware import BodyLimit, UnexpectedErrorsAnswered
from art_backend.protocol import ChatCompletionRequest, TokenRecordsRequest, now
from art_backend.responses import ResponsesRequest, chat_request, from_completion, stream_events
from art_backend.training.routes import training_router
from art_backend.training.service import TrainingService
from art_integrations.wire import BACKEND_HEADER, TOKEN_LOGPROBS_HEADER


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        first = first or location or None
        parts.append(f"{location or 'body'}: {item.get('msg')}")
    return "Invalid request: " + "; ".join(parts), first


async def _unless_client_leaves(request: Request, work: Coroutine[Any, Any, Any]) -> Any:
    """`work`'s result, or, if the client disconnects first, `work` cancelled (its generation
    aborted, its batch slots freed at once) and a 499 no one will read."""
    task = asyncio.ensure_future(work)
    client_left = asyncio.Event()

    async def cancel_on_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        client_left.set()
        task.cancel()

    watcher = asyncio.ensure_future(cancel_on_disconnect())
    try:
        return await task
    except asyncio.CancelledError:
        if not client_left.is_set():
            raise  # the request itself was cancelled (the server is stopping)
        return JSONResponse(error_body("The client disconnected.", "ClientClosedRequest", None, 499), status_code=499)
    finally:
        watcher.cancel()


# on every generated answer: the client's transport capture records a request only where it finds this
MARK = {BACKEND_HEADER: "1"}
# TOKEN_LOGPROBS_HEADER, sent by the client's transport capture: with `return_token_ids`, each choice (or
# chunk, or Response) then carries `token_logprobs` beside `token_ids`, so a capture has a call's exact
# tokens and logprobs with its reply, not from a second request to /v1/art/token_records.


def create_app(engine: Engine, api_key: str | None = None, close_engine_on_shutdown: bool = False,
               training: TrainingService | None = None, max_request_bytes: int = 64 << 20,
               token_records_bytes: int = 256 << 20, continuations_bytes: int = DEFAULT_BUDGET_BYTES,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """The HTTP app over `engine`; with `training`, also the /v1/training routes."""
    service = ChatService(engine, token_records_bytes, continuations_bytes, tool_call_parser, reasoning_parser)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if close_engine_on_shutdown:
            await engine.close()

    app = FastAPI(title="art-backend", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.chat = service
    # inside the key check (added later, so outside): its 413 is raised where the body is read
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    if api_key:
        @app.middleware("http")
        async def require_api_key(request: Request, call_next: Any) -> Any:
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            # the scheme is case-insensitive (RFC 9110), the key is not
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), api_key.encode()):
                return JSONResponse(error_body(
                    "Missing or wrong API key: send `Authorization: Bearer <key>` (the key the backend "
                    "was started with).", "AuthenticationError", code=401), status_code=401)
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error)
        return JSONResponse(error_body(message, "BadRequestError", param, 422), status_code=422)

    @app.exception_handler(ServiceError)
    async def on_service_error(_: Request, error: ServiceError) -> JSONResponse:
        # every refusal's answer is its class's (errors.py), so a new kind needs no handler here
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 413:
            return JSONResponse(error_body(
                f"The request body is larger than this server takes ({max_request_bytes} bytes): send less, or start "
                "the backend with a higher --max-request-bytes (ART_BACKEND_MAX_REQUEST_BYTES).",
                "RequestTooLargeError", None, 413), status_code=413)
        if error.status_code == 400 and error.detail == "There was an error parsing the body":  # FastAPI's words
            return JSONResponse(error_body("Invalid request: the body is not JSON (UTF-8 text) this server can read.",
                                           "BadRequestError", "body", 422), status_code=422)
        # keeps Starlette's headers, such as a 405's `Allow`
        return JSONResponse(error_body(str(error.detail), "HTTPError", None, error.status_code),
                            status_code=error.status_code, headers=error.headers)

    app.add_middleware(UnexpectedErrorsAnswered)

    @app.post("/v1/art/token_records")
    async def token_records(body: TokenRecordsRequest) -> dict[str, Any]:
        """Exact tokens of recent choices made with `return_token_ids`, by choice (message) id."""
        return {"records": {choice_id: service.records.get(choice_id) for choice_id in body.ids}}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = now()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "art-backend",
             "root": engine.base_model_name, "max_model_len": engine.max_model_len}
            for name in engine.served_models()]}

    # a completion is JSON, or with `stream` server-sent events of chunks
    @app.post("/v1/chat/completions", response_model=None, responses={200: {"content": {
        "application/json": {}, "text/event-stream": {}}}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        # tokenizing stays off the event loop
        prepared = await asyncio.to_thread(service.prepare, body, TOKEN_LOGPROBS_HEADER in request.headers)
        if body.stream:  # a stream is aborted when its client leaves (Starlette cancels the generator)
            return StreamingResponse(service.stream(prepared), media_type="text/event-stream", headers=MARK)
        answer = await _unless_client_leaves(request, service.complete(prepared))
        return answer if isinstance(answer, JSONResponse) else JSONResponse(answer, headers=MARK)

    @app.post("/v1/responses", response_model=None, responses={200: {"content": {
        "application/json": {}, "text/event-stream": {}}}})
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        """OpenAI's Responses API over the chat path: see `responses.py`."""
        prepared = await asyncio.to_thread(service.prepare, chat_request(body),
                                           TOKEN_LOGPROBS_HEADER in request.headers)
        if body.stream:
            return StreamingResponse(stream_events(body, service.stream(prepared)), media_type="text/event-stream",
                                     headers=MARK)
        answer = await _unless_client_leaves(request, service.complete(prepared))
        return answer if isinstance(answer, JSONResponse) else JSONResponse(from_completion(body, answer),
                                                                            headers=MARK)

    @app.post("/v1/completions", response_model=None, responses={200: {"content": {
        "application/json": {}, "text/event-stream": {}}}})
    async def text_completions(body: completions.CompletionRequest, request: Request) -> Any:
        """OpenAI's text completions (a prompt string or token ids): see `completions.py`."""
        prepared = await asyncio.to_thread(completions.prepare, service, body, TOKEN_LOGPROBS_HEADER in request.headers)
        if body.stream:
            return StreamingResponse(completions.stream(service, prepared), media_type="text/event-stream",
                                     headers=MARK)
        answer = await _unless_client_leaves(request, completions.complete(service, prepared))
        return answer if isinstance(answer, JSONResponse) else JSONResponse(answer, headers=MARK)

    if training is not None:
        training.chat_formatter = service.formatter  # SFT renders demonstrations exactly as serving prompts
        app.include_router(training_router(training))
    return app
