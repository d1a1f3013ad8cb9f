"""Files that survive a crash: written whole or not at all, appended without gluing, fsynced.

What the backend acknowledges (a trained step, a logged split, a registration) is on disk
before the answer goes out, power loss included, given a disk that honours fsync: each file is
fsynced, and so is the directory that gains or renames it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def fsync_directory(path: Path) -> None:
    """Make the names in `path` (files created, renamed or removed there) durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(path: Path) -> None:
    """fsync every file below `path`, then the directories."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(Path(folder) / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_directory(Path(folder))


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: readers see the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, staging = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines durably (one fsync). A line torn by an earlier crash (no newline at the
    end of the file) is ended first, so it stays a damaged line of its own instead of swallowing
    the first new one."""
    if any("\n" in line for line in lines):
        raise ValueError("append_lines takes lines without newlines")
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    with open(path, "ab+") as handle:
        handle.seek(0, os.SEEK_END)
        torn = False
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            torn = handle.read(1) != b"\n"
        handle.write((b"\n" if torn else b"") + "".join(line + "\n" for line in lines).encode())
        handle.flush()
        os.fsync(handle.fileno())
    if created:
        fsync_directory(path.parent)


def read_json_lines(path: Path) -> list[Any]:
    """The JSON values of `path`'s lines, in order; a line that does not parse (torn by a crash,
    or edited) is skipped with a warning naming it."""
    if not path.is_file():
        return []
    values = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            values.append(json.loads(line))
        except json.JSONDecodeError as error:
            logger.warning("Skipping line %d of %s, which is not JSON (%s): %.80r", number, path, error, line)
    return values
