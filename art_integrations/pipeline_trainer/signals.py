"""Ctrl-C and SIGTERM for the length of a run, the caller's handlers put back after it (asyncio's
`remove_signal_handler` would leave Python's defaults instead)."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def stop_on_signals(handler: Callable[[signal.Signals], None]) -> Callable[[], None] | None:
    """Call `handler(sig)` on the running loop for each stop signal, until the returned function
    is called; None where signals cannot be taken (not the main thread, a loop without them)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    loop = asyncio.get_running_loop()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, handler, sig)
    except (NotImplementedError, RuntimeError):  # Windows' loops
        for sig in STOP_SIGNALS:
            signal.signal(sig, previous[sig])
        return None

    def restore() -> None:
        for sig, old in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, old)

    return restore
