"""The Python examples of README.md and docs/: found here, run by tests/test_docs.py.

An example is a ```python block. One the tests cannot run says so on the page, in the line just
above it: `*Not run by the tests: <the reason>.*`. A page's other examples run in order in one
interpreter (each may use what an earlier one defined), with top-level `await` allowed, as in a
notebook: `python -m tests.doc_examples PAGE` runs them.
"""

from __future__ import annotations

import ast
import asyncio
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_RUN = re.compile(r"^\*Not run by the tests: (?P<reason>.+)\*$")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # the reason the page gives, or None: the tests run it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples(page: Path) -> list[Example]:
    found: list[Example] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        if lines[index].strip() == "```python":
            end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
            above = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
            marked = NOT_RUN.match(above)
            found.append(Example(page, index + 1, "\n".join(lines[index + 1:end]) + "\n",
                                 marked["reason"] if marked else None))
            index = end
        index += 1
    return found


def run(page: Path) -> None:
    """Run the page's runnable examples in order in one namespace; one without a top-level
    `await` runs outside the event loop (so it may call `asyncio.run` itself)."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    loop = asyncio.new_event_loop()
    for example in examples(page):
        if example.not_run is None:
            print(f"--- {example.where}", flush=True)
            code = compile(example.code, example.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            result = eval(code, namespace)  # noqa: S307 - the repository's own documentation
            if asyncio.iscoroutine(result):
                loop.run_until_complete(result)
    loop.close()


if __name__ == "__main__":
    run(Path(sys.argv[1]).resolve())
