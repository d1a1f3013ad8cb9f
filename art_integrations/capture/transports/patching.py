"""Wrapping a client library's send method so that it composes with other libraries' wrappers.

Tracing and error-reporting libraries (OpenTelemetry's and Sentry's httpx instrumentations, say)
wrap the same methods we do. So a method is wrapped once per process, around whatever is there
at the time (a wrapper installed before ours keeps running, inside ours), and never reassigned
afterwards: a wrapper installed after ours calls ours through the reference it took. The one
case in which ours is installed again is a foreign library putting back the very function we
wrapped (un-instrumenting with the original it saved before ours), which removes ours.

A request that reaches a second copy of our wrapper on one call path passes through it
untouched (`handling`), so no call is recorded twice whatever the order of installs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

logger = logging.getLogger(__name__)

MARK = "__art_capture__"  # set on each of our wrappers

# (owner, method name) -> (our wrapper, the function it wraps)
_installed: dict[tuple[type, str], tuple[Callable[..., Any], Callable[..., Any]]] = {}
_handling: ContextVar[bool] = ContextVar("art_transport_handling", default=False)


def _reaches(function: Any, target: Callable[..., Any], depth: int = 32) -> bool:
    """Whether `function` is `target` or wraps it (following `__wrapped__`, which functools.wraps and
    wrapt's proxies set)."""
    for _ in range(depth):
        if function is target:
            return True
        function = getattr(function, "__wrapped__", None)
        if function is None:
            return False
    return False


def wrap_method(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Wrap `owner.name` with `make(current)` unless ours is already there (see the module's doc).
    True when it wrapped now."""
    current = getattr(owner, name)
    installed = _installed.get((owner, name))
    if installed is not None:
        ours, wrapped = installed
        if _reaches(current, ours) or not _reaches(wrapped, current):
            return False  # ours, or a foreign wrapper around it (one that hides what it wraps, too)
        # what ours wrapped (or a function under it) was put back: a foreign un-instrumentation removed ours
        logger.debug("%s.%s lost our capture's wrapper: wrapping it again", owner.__name__, name)
    wrapper = make(current)
    setattr(wrapper, MARK, True)
    wrapper.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
    _installed[(owner, name)] = (wrapper, current)
    return True


def is_installed(owner: type, name: str) -> bool:
    """Whether our wrapper is installed on `owner.name` (as the method or under another wrapper)."""
    return (owner, name) in _installed


@contextmanager
def handling() -> Iterator[bool]:
    """Yields whether this request is new to our wrappers (True: handle it); a nested copy of our
    wrapper on the same call gets False and passes the request by."""
    if _handling.get():
        yield False
        return
    token = _handling.set(True)
    try:
        yield True
    finally:
        _handling.reset(token)
