"""This process's resident memory as Linux accounts it (/proc/self/status), and a reset of its peak,
so a benchmark can report the peak of each measured step on its own."""

from __future__ import annotations

from pathlib import Path

STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def resident_mib() -> tuple[float, float]:
    """(resident now, peak resident since the start or the last `reset_peak()`), in MiB."""
    fields = dict(line.split(":", 1) for line in STATUS.read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    """Start a new peak from the resident memory now (Linux 4.0 and later: writing 5 to clear_refs)."""
    CLEAR_REFS.write_text("5")
