"""The `art-integrations` command. argparse and `input()` from the standard library: the client
package keeps its dependencies few, and one prompt loop with checks is all the wizard needs."""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Callable
from pathlib import Path

from art_integrations.wizard.questions import QUESTIONS, ask_all
from art_integrations.wizard.script import EXAMPLE_AGENT, example_scenarios, render


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="art-integrations", description="RL-train the agents you already have.")
    commands = parser.add_subparsers(dest="command", required=True)
    init = commands.add_parser("init", help="write a runnable GRPO training script, asking one question at a time",
                               description="Asks what the training needs (each question also has a flag) and "
                                           "writes a training script you run with `python SCRIPT`.")
    init.add_argument("path", nargs="?", type=Path, help="the script to write (default: train_<name>.py)")
    for question in QUESTIONS:
        init.add_argument(question.flag, dest=question.key, metavar=question.key.upper(), help=question.prompt)
    init.add_argument("--yes", "-y", action="store_true", help="take the default of every question not given "
                      "as a flag (no questions asked)")
    init.add_argument("--force", action="store_true", help="overwrite existing files without asking")
    return parser


def _may_write(path: Path, force: bool, interactive: bool, read: Callable[[str], str]) -> bool:
    if not path.exists() or force:
        return True
    if not interactive:
        raise SystemExit(f"{path} exists: not overwritten. Give another path, or --force to overwrite it.")
    return read(f"{path} exists. Overwrite it? [y/N]: ").strip().lower() in ("y", "yes")


def init(args: argparse.Namespace, read: Callable[[str], str] = input) -> int:
    interactive = not args.yes and sys.stdin.isatty()
    if not args.yes and not interactive:
        raise SystemExit("stdin is not a terminal: give --yes (with flags for what differs from the defaults) "
                         "to run without questions")
    answers = ask_all(vars(args), interactive, read)
    script = args.path or Path(f"train_{answers['name'].replace('-', '_').replace('.', '_')}.py")
    if script.suffix != ".py":
        raise SystemExit(f"{script}: the script must be a .py file")
    written: list[Path] = []
    scenarios = Path(answers["scenarios"]) if answers.get("scenarios") else script.with_name(
        f"{script.stem}_scenarios.jsonl")
    agent_module = None
    extra: dict[Path, str] = {}
    if not answers.get("scenarios"):
        extra[scenarios] = example_scenarios()
    if answers["pattern"] == "agent" and not answers.get("agent"):
        agent_path = script.with_name(f"{script.stem}_agent.py")
        extra[agent_path] = EXAMPLE_AGENT
        agent_module = agent_path.stem
    text = render(answers, script, scenarios, agent_module)
    ast.parse(text, filename=str(script))  # never write a script that does not parse
    files = [(script, text), *extra.items()]
    # every file is asked about (or refused) before any is written: no half-written project
    kept = {path for path, _ in files if not _may_write(path, args.force, interactive, read)}
    for path, content in files:
        if path in kept:
            print(f"kept {path} as it is")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        written.append(path)
    for path in written:
        print(f"wrote {path}")
    if script in written:
        print(f"\nNext: read {script}, edit its reward and scenarios, then run\n    python {script}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "init":
        return init(args)
    return 2

