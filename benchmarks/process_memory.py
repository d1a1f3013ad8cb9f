"""A process's resident memory as Linux accounts it (/proc/PID/status; this process's by default),
and a reset of its peak, so a benchmark can report the peak of each measured step on its own."""

from __future__ import annotations

from pathlib import Path


def resident_mib(pid: int | str = "self") -> tuple[float, float]:
    """(resident now, peak resident since the start or the last `reset_peak()`), in MiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak(pid: int | str = "self") -> None:
    """Start a new peak from the resident memory now (Linux 4.0 and later: writing 5 to clear_refs;
    another process's needs the same user)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
