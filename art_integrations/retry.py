"""`@retry`: call a rollout (or any function, async or not) again when it fails with a transient
error, with exponential backoff; ART's decorator and arguments, on tenacity (the library made
for this)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import tenacity

logger = logging.getLogger(__name__)

Function = TypeVar("Function", bound=Callable[..., Any])


def retry(max_attempts: int = 3, delay: float = 0.25, backoff_factor: float = 2.0,
          exceptions: tuple[type[BaseException], ...] = (Exception,),
          on_retry: Callable[[BaseException, int], None] | None = None) -> Callable[[Function], Function]:
    """Up to `max_attempts` calls; before each retry, wait `delay * backoff_factor ** (attempt - 1)`
    seconds and call `on_retry(error, attempt)` (default: a warning naming the error). Errors not
    in `exceptions`, and the last one, are raised as they are."""
    if not isinstance(max_attempts, int) or max_attempts < 1:
        raise ValueError(f"max_attempts must be an integer of at least 1, got {max_attempts!r}")
    if not isinstance(exceptions, tuple) or not all(isinstance(e, type) and issubclass(e, BaseException)
                                                    for e in exceptions):
        raise TypeError(f"exceptions must be a tuple of exception classes, got {exceptions!r}")

    def before_sleep(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        assert error is not None
        if on_retry is not None:
            on_retry(error, state.attempt_number)
        else:
            logger.warning("Retry %d/%d for %s after %s: %s", state.attempt_number, max_attempts,
                           getattr(state.fn, "__name__", state.fn), type(error).__name__, error)

    return tenacity.retry(stop=tenacity.stop_after_attempt(max_attempts),
                          wait=tenacity.wait_exponential(multiplier=delay, exp_base=backoff_factor, min=0),
                          retry=tenacity.retry_if_exception_type(exceptions), before_sleep=before_sleep, reraise=True)
