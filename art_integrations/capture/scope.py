"""The capture scope: `ModelCall` (one call as an integration or the transport saw it), `CaptureScope`
(the calls of one `art_capture()`, and its errors), and the context that says which scope is open
here (`current_capture`, `current_trajectory`, `no_capture`, `record_call`).

The lowest of the capture modules: the transports and the integrations record into it, the token
fetch (`tokens.py`) and the assembly (`assembly.py`) read it, and `art_capture()`
(the package, `__init__.py`) opens it; it imports none of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from art_integrations.trajectory import Choice, Trajectory

# the logger art_capture() has always logged under (what a user configures), wherever its code sits
logger = logging.getLogger("art_integrations.capture")


@dataclass
class ModelCall:
    """One model call as an integration saw it; `choice` gets its exact tokens on capture exit."""

    endpoint: str  # the OpenAI base URL the call went to (…/v1)
    record_id: str | None  # the choice's id on the backend (its message id), None if not returned
    messages: list[dict[str, Any]]
    response: dict[str, Any]  # the assistant message, OpenAI-shaped
    finish_reason: str | None = None
    tools: list[dict[str, Any]] | None = None
    agent: str = ""  # "" = the main agent
    metadata: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    api_key: str | None = None
    choice: Choice | None = None  # its exact tokens: read from the reply by the transport, or fetched at exit
    via_transport: bool = False  # seen where an HTTP client sent it (transports/)
    teacher: bool = False  # another server's reply (art_capture(teacher=True)): a message, no tokens
    tokenless: bool = False  # its tokens cannot be had (the capture's errors say why): a message only

    @property
    def waits_for_tokens(self) -> bool:
        """No exact tokens yet, and some to come (a teacher's reply has none)."""
        return self.choice is None and not self.teacher and not self.tokenless


LATE_CALL = ("a model call finished after its art_capture() had exited (a task started inside the capture and "
             "awaited outside it?), so it is not in the trajectory: await every task the rollout starts before "
             "leaving the `with art_capture()` block")
NO_CALLS = ("art_capture() recorded no model call, so the trajectory is empty. Likely causes: the model was not "
            "called at an art-backend through an HTTP client the capture sees (httpx, httpx2, requests, aiohttp: "
            "the openai SDK and any framework or hand-written agent on them is recorded with its base URL pointed "
            "at the backend's /v1, as a POST to chat/completions, responses or completions); a client it cannot "
            "see (a websocket, gRPC, another HTTP library, another path; DSPy's default engine, which opens its own "
            "sockets: give dspy.LM engine=\"litellm\") needs an integration: ChatART, ARTLLM, "
            "config={'callbacks': [ARTCallbackHandler()]} for your own ChatOpenAI, "
            "art_integrations.llamaindex.instrument() for your own LlamaIndex LLM, or trajectory.add_response() "
            "with the backend's reply; they ran inside no_capture(); the calls ran in a task still running when "
            "the capture exited (await it inside the capture); or they ran in a thread that does not carry the "
            "capture's context (use asyncio.to_thread, not run_in_executor or a bare Thread)")


class CaptureScope:
    def __init__(self, trajectory: Trajectory, teacher: bool = False) -> None:
        self.trajectory = trajectory
        self.teacher = teacher  # replies of servers that are not backends are recorded too, as messages
        self.calls: list[ModelCall] = []
        self.placeholders: list[tuple[list[Any], int, ModelCall]] = []  # replies waiting for their tokens
        # (model, fix) -> how many calls an integration saw in this capture but could not record
        self.unrecorded: Counter[tuple[str, str]] = Counter()
        self._closed = False  # the capture exited: its calls are assembled, a call arriving now is late
        self._late: set[str | None] = set()  # the record ids of late calls
        self._lock = threading.Lock()  # calls may arrive from executor threads

    def add(self, call: ModelCall) -> bool:
        """Keep `call`; False (and a capture error) when the capture has already exited."""
        with self._lock:
            if not self._closed:
                self.calls.append(call)
                return True
            reported = call.record_id is not None and call.record_id in self._late
            self._late.add(call.record_id)
        if not reported:  # a late call that an integration and the transport both saw is one late call
            self.error(LATE_CALL)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def note_unrecorded(self, model: str, fix: str) -> None:
        """An integration saw a call to `model` here that it cannot record (no handler for it).
        A judge or helper model beside the policy is normal; it becomes a capture error only if
        the capture records nothing else (see `report_if_empty`)."""
        logger.debug("A call to %s inside art_capture(): served, not recorded", model)
        with self._lock:
            self.unrecorded[(model, fix)] += 1

    def report_if_empty(self) -> None:
        """A capture that recorded no call has nothing to train on, and is almost always a setup
        mistake: say which, naming the models seen without a handler when an integration saw any."""
        if self.calls or any(history.choices() for history in self.trajectory.histories()):
            return
        with self._lock:  # a late note may still arrive from another thread
            unrecorded = list(self.unrecorded.items())
        for (model, fix), count in unrecorded:
            self.error(f"art_capture() recorded no model call, but {count} call{'s' * (count > 1)} to {model} "
                       f"ran inside it unrecorded: {fix}")
        if not unrecorded:
            self.error(NO_CALLS)

    def error(self, message: str) -> None:
        """A recording problem: kept in the trajectory's logs and counted, never dropped."""
        logger.warning("art_capture: %s", message)
        with self._lock:
            self.trajectory.logs.append(f"capture error: {message}")
            errors = self.trajectory.metrics.get("capture_errors", 0)
            self.trajectory.metrics["capture_errors"] = int(errors) + 1


_current: ContextVar[CaptureScope | None] = ContextVar("art_capture", default=None)


def current_capture() -> CaptureScope | None:
    return _current.get()


def current_trajectory(*, require: bool = False) -> Trajectory | None:
    """ART's `current_trajectory()`: the trajectory the innermost open capture records into
    (None outside one; with `require=True`, a RuntimeError)."""
    scope = _current.get()
    if scope is None and require:
        raise RuntimeError("No trajectory is being captured here: call this inside `async with art_capture()` "
                           "(or a rollout run by art.trajectory(...))")
    return scope.trajectory if scope is not None else None


@contextmanager
def no_capture() -> Iterator[None]:
    """ART's `no_capture()`: model calls inside are not recorded into the enclosing capture (a
    judge or helper model on the same backend); a capture opened inside records its own."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def record_call(call: ModelCall, scope: CaptureScope | None = None) -> bool:
    """Add `call` to `scope` (default: the capture open here). False when there is none, or it
    has exited (a late call: counted as a capture error)."""
    scope = scope or _current.get()
    if scope is None:
        logger.debug("Model call outside art_capture(): served, not recorded")
        return False
    return scope.add(call)
