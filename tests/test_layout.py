"""The package's shape holds: no import circle among its modules (imports inside functions and
under TYPE_CHECKING count too), and no module much over the ~400 lines one job takes."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

PACKAGES = {"art_integrations": REPO / "art_integrations", "art_backend": REPO / "backend" / "art_backend"}
# Imports of a module that depends on an optional package, made where that package is used: the
# edge goes from the client to the backend, which the client installs without (LocalBackend's
# in-process server); no module of the backend imports the client's backend module back.
OPTIONAL_EDGES = {("art_integrations.backend", "art_backend.app"), ("art_integrations.backend", "art_backend.config")}
MAX_LINES = 420


def _modules() -> dict[str, Path]:
    found = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((package, *parts))
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports anywhere in it (a name imported from a package counts
    as its submodule where one has that name)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) - {b for a, b in OPTIONAL_EDGES if a == name}
             for name, path in modules.items()}
    circles, state = [], dict.fromkeys(graph, 0)

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state[target] == 1:
                circles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif state[target] == 0:
                visit(target, [*stack, target])
        state[node] = 2

    for name in sorted(graph):
        if state[name] == 0:
            visit(name, [name])
    assert not circles, "import circles (move the shared names to a module both sides import):\n" + "\n".join(circles)


def test_modules_stay_one_job_long() -> None:
    long = {str(path.relative_to(REPO)): n for path in _modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: split them by job (docs/contributing/layout.md): {long}"


def test_the_layout_page_names_every_module() -> None:
    """docs/contributing/layout.md is the map a newcomer reads first: every module, kernel header and
    folder of both packages is named there, so a new one is drawn on the map when it is added."""
    page = (REPO / "docs" / "contributing" / "layout.md").read_text()
    unnamed = []
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*")):
            if "__pycache__" in path.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            if path.is_dir() and f"{path.name}/`" not in page:
                unnamed.append(f"{path.relative_to(REPO)}/")
            elif path.suffix in (".py", ".cpp", ".h") and f"{path.name}`" not in page:
                unnamed.append(str(path.relative_to(REPO)))
    assert not unnamed, f"docs/contributing/layout.md does not name: {unnamed} (add each to the row of its folder)"
