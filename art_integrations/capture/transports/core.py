"""What every HTTP client's adapter shares: which requests are generations, which servers are
backends, and how a reply becomes the trajectory's `ModelCall`s.

An adapter (one per client library, beside this module) calls `begin()` for each request it
sends inside a capture; `None` means "not a generation request, pass it by" (the common case
costs a path check). For a generation, `Exchange.ask_tokens` says whether to add
`wire.TOKEN_LOGPROBS_HEADER`: only to a server already known to be a backend, so that a request to
any other server leaves exactly as the agent wrote it. Whether a reply is recorded is decided by
the reply itself (`Exchange.answered`: a 200 carrying `wire.BACKEND_HEADER`), which is also how a
server becomes known as a backend, unless a backend client said so first (`known_backend`: a
`RemoteBackend` or `LocalBackend` knows its URL). A first call to a backend no one named goes
out untouched: its reply still carries the token ids (the backend sends them unless told not
to) and its record id, so only its logprobs are missing, and the capture fetches those at exit
with the handlers' calls (`capture.tokens.fetch_tokens`); every later call reads them from the
reply.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from art_integrations.capture.scope import CaptureScope
from art_integrations.capture.transports.replies import CHAT, COMPLETIONS, RESPONSES, calls_from_reply

EVENT_STREAM = "text/event-stream"

# origin ("http://host:port") -> whether its generated replies carried BACKEND_HEADER. Only used to decide
# whether to ask for logprobs; whether to record is decided by each reply (a port may change hands).
_backends: dict[str, bool] = {}


def generation_kind(method: str, path: str) -> str | None:
    """CHAT, RESPONSES or COMPLETIONS for a generation request; None for any other request."""
    if method.upper() != "POST":
        return None
    path = path.rstrip("/")
    if path.endswith(CHAT):
        return CHAT
    if path.endswith(RESPONSES):
        return RESPONSES
    if path.endswith(COMPLETIONS):
        return COMPLETIONS
    return None


@dataclass
class Exchange:
    """One generation request inside a capture, from its sending to its recorded reply."""

    scope: CaptureScope
    kind: str
    url: str  # without its query
    origin: str
    api_key: str | None
    ask_tokens: bool  # the request goes out with TOKEN_LOGPROBS_HEADER (a known backend)
    sent: Callable[[], Any]  # the request's JSON body, read only when the reply is recorded
    from_backend: bool = False  # the reply carried BACKEND_HEADER (else a teacher's, under teacher=True)

    @property
    def endpoint(self) -> str:
        """The OpenAI base URL (…/v1) the request went to."""
        return self.url.rstrip("/").removesuffix(self.kind)

    def answered(self, status: int, backend_header: bool) -> bool:
        """Whether the reply is to be recorded: a backend's generated answer, or under
        `art_capture(teacher=True)` any server's. An error (the rollout sees it raised) is not; a 200
        teaches which servers are backends."""
        if status == 200:
            _backends[self.origin] = backend_header
        self.from_backend = backend_header
        return status == 200 and (backend_header or self.scope.teacher)

    def record(self, body: bytes, content_type: str) -> None:
        """Read the whole reply `body` into the capture: each call, or the error saying why not."""
        try:
            calls = calls_from_reply(self.kind, self.sent(), body, EVENT_STREAM in content_type,
                                     self.endpoint, self.api_key)
        except Exception as error:  # the agent has its reply: a failure here is the trajectory's, said there
            self.scope.error(f"a reply from {self.url} could not be read for the trajectory: {error!r}")
            return
        if calls is None:
            self.scope.error(f"a streamed reply from {self.url} was closed before its end, so it is not recorded: "
                             "read the whole stream inside the capture")
            return
        for call in calls:
            if not self.from_backend:  # a teacher's reply: its message; any token ids in it are not the policy's
                call.teacher, call.record_id, call.choice = True, None, None
                self.scope.add(call)
            elif call.record_id is None:  # an integration that records the call says so too: named if nothing else is
                self.scope.note_unrecorded(f"{call.endpoint} without token ids",
                                           "leave return_token_ids on (the backend's default) rather than sending "
                                           "false")
            else:
                self.scope.add(call)


def begin(scope: CaptureScope, method: str, url: str, authorization: str | None,
          sent: Callable[[], Any]) -> Exchange | None:
    """The exchange a request starts, or None when it is not a generation request to record."""
    if method.upper() != "POST":  # before parsing the URL: most requests end here
        return None
    parts = urlsplit(url)
    kind = generation_kind(method, parts.path)
    if kind is None:
        return None
    origin = f"{parts.scheme}://{parts.netloc}"
    scheme, _, key = (authorization or "").partition(" ")
    return Exchange(scope=scope, kind=kind, url=f"{origin}{parts.path}", origin=origin,
                    api_key=key.strip() if scheme.lower() == "bearer" else None,
                    ask_tokens=_backends.get(origin, False), sent=sent)


def json_body(content: bytes | str | None) -> Callable[[], Any]:
    """A reader of a request body sent as JSON text."""
    def read() -> Any:
        if content is None:
            raise ValueError("the request has no body")
        return json.loads(content)
    return read


def known_backend(url: str, is_backend: bool = True) -> None:
    """Say that the server at `url` is (or is not) a backend, before any reply has said so: the
    backend clients (`RemoteBackend`, `LocalBackend`) know their URL, so even the first call to
    it reads its logprobs from the reply."""
    parts = urlsplit(url)
    _backends[f"{parts.scheme}://{parts.netloc}"] = is_backend


class Collected:
    """The bytes a streamed reply has handed on so far, given whole to `done` once: at its end, or
    at its close (then cut short, which `Exchange.record` reports)."""

    def __init__(self, done: Callable[[bytes], None]) -> None:
        self.done, self.parts, self.finished = done, bytearray(), False

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.done(bytes(self.parts))
