"""The documentation holds: the site builds with `mkdocs build --strict` (a broken link, nav entry or
API reference fails it), every Python example in README.md and docs/ runs against the tiny model
or says on its page why it cannot, and every backend setting the pages name exists, and every
setting is in the settings table."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from art_backend.cli import app
from art_backend.config import BackendSettings

from art_integrations import LoraConfig, TrainConfig

from tests.conftest import checkout_env
from tests.doc_examples import ROOT, Example, examples, pages

SETTINGS_PAGE = ROOT / "docs" / "backend" / "settings.md"
TINY = "tiny-random-smollm2"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "reference" / "client" / "index.html").read_text().count('class="doc doc-heading"') > 20


# ----- the examples -----

def _pages_with_examples() -> list[object]:
    params: list[object] = []
    for page in pages():
        found = examples(page)
        where = str(page.relative_to(ROOT))
        if any(example.not_run is None for example in found):
            params.append(pytest.param(page, id=where))
        params += [pytest.param(page, id=example.where, marks=pytest.mark.skip(reason=example.not_run))
                   for example in found if example.not_run is not None]
    return params


@pytest.mark.parametrize("page", _pages_with_examples())
def test_the_examples_run(page: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    """A page's examples in order, in a fresh interpreter, with the tiny model as the backend's
    (`ART_BACKEND_MODEL`, which `LocalBackend()` reads) and a scratch directory as the working one.
    The fused CPU kernels stay off: their one-time build would only slow these down, and a build
    killed by the timeout would leave torch's extension lock behind for every later start."""
    env = checkout_env(ART_BACKEND_MODEL=TINY, ART_BACKEND_CPU_KERNELS="false", WANDB_MODE="disabled")
    ran = subprocess.run([sys.executable, "-m", "tests.doc_examples", str(page)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-6000:]


def all_examples() -> list[Example]:
    return [example for page in pages() for example in examples(page)]


def test_every_example_parses_and_imports_only_names_that_exist() -> None:
    """Those not run included: an example naming a function we do not have fails here."""
    missing = []
    for example in all_examples():
        for node in ast.walk(ast.parse(example.code)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "art_integrations":
                module = importlib.import_module(node.module)
                missing += [f"{example.where}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)]
    assert not missing


def test_a_page_marks_an_example_as_not_run_only_with_a_reason() -> None:
    for page in pages():
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.strip().startswith("*Not run by the tests"):
                assert re.fullmatch(r"\*Not run by the tests: .{10,}\*", line.strip()), f"{page}:{number}"


# ----- the backend's settings -----

def _serve_options(command: str) -> dict[str, str]:
    """`--flag` -> the BackendSettings field it sets, for `art-backend <command>`."""
    click_command = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    return {option: param.name for param in click_command.params for option in param.opts if option.startswith("--")}


def _settings_rows() -> list[tuple[str, str]]:
    """(`--flag` or "", `ART_BACKEND_*`) of every row of the settings page's tables."""
    rows = []
    for line in SETTINGS_PAGE.read_text().splitlines():
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[1].startswith("ART_BACKEND_"):
            rows.append((cells[0], cells[1]))
    return rows


def test_the_settings_tables_name_every_setting_once_with_its_option() -> None:
    options = _serve_options("serve")
    rows = _settings_rows()
    variables = [variable for _, variable in rows]
    assert sorted(variables) == sorted(f"ART_BACKEND_{field.upper()}" for field in BackendSettings.model_fields)
    for flag, variable in rows:
        field = variable.removeprefix("ART_BACKEND_").lower()
        if flag:
            assert options.get(flag) == field, f"{flag} is not `art-backend serve`'s option for {variable}"
        else:
            assert field not in options.values(), f"{variable}'s row lacks its option"


def test_every_setting_and_option_the_pages_name_exists() -> None:
    fields = set(BackendSettings.model_fields)
    commands = {command: _serve_options(command) for command in ("serve", "view", "export")}
    wrong = []
    for page in pages():
        text = page.read_text()
        wrong += [f"{page.name}: {name}" for name in set(re.findall(r"\bART_BACKEND_([A-Z0-9_]*[A-Z0-9])\b", text))
                  if name.lower() not in fields]
        for command, options in commands.items():
            for line in re.findall(rf"art-backend {command}\b([^\n`]*)", text):
                wrong += [f"{page.name}: art-backend {command} {flag}" for flag in re.findall(r"(--[a-z][a-z0-9-]*)", line)
                          if flag not in options and flag != "--help"]
    assert not wrong


def _first_column(page: Path, header: str) -> list[str]:
    """The first cells of the rows of the table whose first header cell is `header`."""
    cells, inside = [], False
    for line in page.read_text().splitlines():
        first = line.strip().strip("|").split("|")[0].strip() if line.startswith("|") else None
        if first == header:
            inside = True
        elif first is None:
            inside = False
        elif inside and not first.startswith("---"):
            cells.append(first.strip("`"))
    return cells


@pytest.mark.parametrize("config", [TrainConfig, LoraConfig], ids=lambda config: config.__name__)
def test_the_training_settings_tables_name_every_field(config: type) -> None:
    documented = _first_column(ROOT / "docs" / "training" / "grpo.md", f"`{config.__name__}` field")
    assert sorted(documented) == sorted(config.model_fields)


def test_the_readmes_links_reach_pages_and_their_headings() -> None:
    """mkdocs checks the links between pages; the README, outside the site, is checked here: each
    relative link names a file, and an anchor on a page one of that page's headings (as mkdocs'
    toc writes its id)."""
    from markdown import Markdown

    broken = []
    for target, anchor in re.findall(r"\]\(((?!https?:)[^)#]+)(?:#([^)]+))?\)", (ROOT / "README.md").read_text()):
        page = ROOT / target
        if not page.exists():
            broken.append(target)
        elif anchor:
            converter = Markdown(extensions=["toc"])
            converter.convert(page.read_text())
            ids = {entry["id"] for entry in _flatten(converter.toc_tokens)}  # type: ignore[attr-defined]
            if anchor not in ids:
                broken.append(f"{target}#{anchor}")
    assert not broken


def _flatten(tokens: list[dict]) -> list[dict]:
    return [entry for token in tokens for entry in (token, *_flatten(token["children"]))]
