"""`art_capture()`: every model call made inside lands in one trajectory, with exact tokens.

A call's exact tokens take one path: the HTTP transport (`transports/`) sees every generation
request an HTTP client sends inside the capture and reads the tokens from the backend's reply.
Integrations (the LangChain callback handler, the LlamaIndex handler, the drop-in models) add
structure only: each finished call they `record_call()` names the agent and node it ran in, and
is joined to the transport's copy of it by record id (`assembly._once`). A call goes to
the innermost capture open in the caller's context (a `ContextVar`, so concurrent asyncio tasks and
LangChain's executor threads each see their own). On exit the calls become the trajectory's
conversations; the logprobs of replies that did not bring them (the first call to a backend no
client named) are then fetched from the backend in one request, or under
`gather_trajectory_groups` once per group:

- calls are grouped by agent (LangGraph's checkpoint namespace: the root graph is the main
  agent, each subgraph a sub-agent);
- within an agent, a call continues a conversation when its messages extend that
  conversation's last call and reply, else it starts a branch;
- the main agent's first conversation is the trajectory's own; every other one becomes an
  additional history.

No call is lost silently: a call that finishes after its capture exited, and a capture that
recorded no call (naming the model calls an integration saw but could not record, when there
were any), are each warned and counted in `metrics["capture_errors"]`.

This package's `__init__` opens and closes a capture; the rest is split by job, each importing only the scope:
`scope.py` (`ModelCall`, `CaptureScope` and which one is open here), `tokens.py`
(the token fetch at exit) and `assembly.py` (the calls into histories).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import traceback
from collections.abc import Coroutine
from contextvars import Token
from typing import Any

from art_integrations.capture.scope import (
    LATE_CALL,
    NO_CALLS,
    CaptureScope,
    ModelCall,
    _current,
    current_capture,
    current_trajectory,
    no_capture,
    record_call,
)
from art_integrations.capture.tokens import _deferred, deferred_token_fetch, exact_choice, fetch_tokens
from art_integrations.trajectory import Trajectory
from art_integrations.capture.assembly import assemble
from art_integrations.capture.transports import install as install_transports

logger = logging.getLogger(__name__)


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """ART's `art.trajectory(rollout(...))`: runs the coroutine inside `art_capture()` and returns
    the trajectory its model calls made (its own return value is not used)."""
    if not isinstance(coroutine, Coroutine):
        raise TypeError(f"art.trajectory() takes a coroutine not yet started, as `rollout(scenario)` gives, not "
                        f"{type(coroutine).__name__}")
    async with art_capture() as captured:
        await coroutine
    return captured


# Where each agent framework's integration can notice the calls no handler of ours sees, keyed
# by the framework's module: a capture sets one up only for a framework the process has loaded.
# Both are optional dependencies (the langchain and llamaindex extras), so they are imported by
# name when a capture opens, never at the top of this module.
_WATCHES = {"langchain_core": "art_integrations.langchain.callback",
            "llama_index.core": "art_integrations.llamaindex.handler"}
_unwatchable: set[str] = set()  # loaded without our extra's packages: nothing to set up


def _watch_frameworks() -> None:
    """Let each loaded framework's integration note unrecorded calls into the open capture, so
    that a user who kept a plain ChatOpenAI or OpenAILike and never imported our integration
    still learns which model went unrecorded. Cheap after the first capture (each `watch()`
    is idempotent)."""
    for framework, module in _WATCHES.items():
        if framework in sys.modules and framework not in _unwatchable:
            try:
                importlib.import_module(module).watch()
            except ImportError as error:
                _unwatchable.add(framework)
                logger.debug("Cannot watch %s for unrecorded calls (%r): a capture that records nothing says "
                             "only the likely causes", framework, error)


# ----- the context manager -----------------------------------------------------------------


class art_capture:  # noqa: N801 - used like a function: `with art_capture() as trajectory:`
    """Record every model call made inside into a `Trajectory` (sync `with` or `async with`).

    Calls from asyncio tasks created inside, and from LangChain's executor threads, are
    included; concurrent captures never mix. Nested captures are allowed: a call goes to the
    innermost one. An exception inside propagates; the partial trajectory stays available.
    A call that finishes after the capture exited (a task not awaited inside), and a capture
    that records nothing, are warned and counted in `metrics["capture_errors"]`.

    `teacher=True` records the calls to OpenAI-compatible servers that are not an art-backend as
    well (a stronger model whose runs become `train_sft` data), as plain messages without token
    ids; off by default, so that a judge or a helper model stays out of the trajectory.
    """

    def __init__(self, trajectory: Trajectory | None = None, *, teacher: bool = False, **metadata: Any) -> None:
        if not isinstance(teacher, bool):
            raise TypeError(f"art_capture(teacher={teacher!r}): True or False (record calls to servers that are "
                            "not an art-backend as messages without tokens)")
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.trajectory.metadata.update(metadata)
        self.scope = CaptureScope(self.trajectory, teacher=teacher)
        self._token: Token[CaptureScope | None] | None = None

    def __enter__(self) -> Trajectory:
        install_transports()  # every loaded HTTP client's generation requests, captured at its transport
        _watch_frameworks()
        self._token = _current.set(self.scope)
        return self.trajectory

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close()
        self._finish(failed=exc_type is not None)
        if self._fetch_now():
            fetch_tokens([self.scope])

    async def __aenter__(self) -> Trajectory:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close()
        self._finish(failed=exc_type is not None)
        if self._fetch_now():
            await asyncio.to_thread(fetch_tokens, [self.scope])

    def _close(self) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    def _finish(self, failed: bool) -> None:
        """Assemble the calls; `failed`: the body raised, which says more than an empty capture would."""
        self.scope.close()  # first: a call landing during assembly is late, not half-assembled
        try:
            assemble(self.scope)
        except Exception:  # a bug here must not eat the rollout: keep it visible on the trajectory
            self.scope.error("assembling the trajectory failed:\n" + traceback.format_exc())
        if not failed:
            self.scope.report_if_empty()

    def _fetch_now(self) -> bool:
        """Whether this exit must fetch missing tokens itself: not when none is missing, nor
        under a `deferred_token_fetch`, whose pending list the scope then joins."""
        if not any(call.waits_for_tokens for call in self.scope.calls):
            return False
        pending = _deferred.get()
        if pending is None:
            return True
        pending.append(self.scope)
        return False


# The capture's names, wherever their code now sits (scope.py, tokens.py,
# assembly.py): `from art_integrations.capture import X` keeps working.
__all__ = [
    "LATE_CALL",
    "NO_CALLS",
    "CaptureScope",
    "ModelCall",
    "art_capture",
    "assemble",
    "current_capture",
    "current_trajectory",
    "deferred_token_fetch",
    "exact_choice",
    "fetch_tokens",
    "no_capture",
    "record_call",
    "trajectory",
]
