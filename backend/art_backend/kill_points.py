"""Moments at which a crash test may kill the backend outright (SIGKILL: no cleanup, as the OOM
killer or a power cut would), to check that a restart recovers. `ART_TEST_KILL_AT` names them,
comma-separated; unset (always, outside such tests) `kill_point` does nothing.
"""

from __future__ import annotations

import os
import signal

MOMENTS = (
    "step_started",          # a train step was asked for; nothing of it is on disk
    "checkpoint_half_written",  # the adapter is written, the optimizer state is not
    "checkpoint_written",    # the step's files are complete in staging, not yet committed
    "step_committed",        # the checkpoint is renamed into place; history and trajectories not yet published
    "history_appended",      # the history line is written; the trajectories are not yet published
    "step_published",        # everything is on disk; the new checkpoint is not yet served
)
# moments of a push to object storage (training/sync.py), apart: MOMENTS are a train step's, in order
SYNC_MOMENTS = (
    "push_files_uploaded",   # a push copied its files to the store; its manifest is not yet written
)

_KILL_AT = frozenset(name for name in os.environ.get("ART_TEST_KILL_AT", "").split(",") if name)
if not _KILL_AT <= set(MOMENTS + SYNC_MOMENTS):
    raise RuntimeError(f"ART_TEST_KILL_AT names unknown moments {sorted(_KILL_AT - set(MOMENTS + SYNC_MOMENTS))}; "
                       f"known: {', '.join(MOMENTS + SYNC_MOMENTS)}")


def kill_point(moment: str) -> None:
    if moment in _KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
