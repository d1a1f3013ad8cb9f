"""`art-backend serve --exit-with-parent`: the server stops when the process that started it is gone.

`LocalBackend` starts its server so. A script that ends normally stops it (close(), or the exit
hook), but a script killed by SIGKILL, or by SIGTERM without a handler, runs neither, and its
server would go on holding the cores and memory of a model nobody can reach. A dead parent is
seen as this process being handed to another (`os.getppid()` changes): no pid is ever compared
that the system could have reused.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

logger = logging.getLogger(__name__)


def exit_with_parent(poll_seconds: float = 1.0, grace_seconds: float = 60.0) -> threading.Thread:
    """Watch the parent on a daemon thread: once it is gone, SIGTERM this process (uvicorn's
    graceful shutdown, as `LocalBackend.stop()` asks for), and if that has not ended it within
    `grace_seconds`, SIGKILL (a step being written is rolled back at the next start: reliability.md)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        logger.warning("The process that started this backend (pid %d) has exited: stopping the backend", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_seconds)
        logger.warning("The backend is still running %.0f s after its parent exited: stopping it at once",
                       grace_seconds)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))

    thread = threading.Thread(target=watch, name="art-backend-parent-watch", daemon=True)
    thread.start()
    return thread
