"""`art-integrations init`: every pattern x reward written non-interactively, linted, and run for
one training step on the tiny model; the interactive flow typed into a real terminal (pexpect),
bad answers asked again with the reason; bad flags refused by name; nothing overwritten unasked."""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pexpect
import pytest

from art_integrations.wizard import main
from tests.conftest import REPO

WIZARD = [sys.executable, "-m", "art_integrations.wizard", "init"]
ONE_STEP = ["--steps", "1", "--rollouts", "2", "--groups-per-step", "1", "--held-out", "2"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def _lint(directory: Path) -> None:
    """ruff over the written files, from their directory as a user's project root (so the agent
    module beside the script is first-party)."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "--no-cache", "--isolated", "--line-length", "120", "--select",
                             "E,F,W,I,B,UP", "."], capture_output=True, text=True, cwd=directory)
    assert result.returncode == 0, result.stdout + result.stderr


# Each pattern x reward trains a step on the session's tiny backend (`--backend-url`); one also starts
# its own backend, as a user's first run does, and is run again with --serve.
OWN_BACKEND = ("single-turn", "programmatic", None)


@pytest.mark.parametrize(("pattern", "reward", "agent"), [
    ("single-turn", "programmatic", None), ("single-turn", "ruler", None),
    ("multi-turn", "programmatic", None), ("multi-turn", "ruler", None),
    ("tools", "programmatic", None), ("tools", "ruler", None),
    ("agent", "programmatic", None), ("agent", "ruler", None),
    ("agent", "programmatic", "examples.llamaindex_agent.agent:build_agent"),
])
def test_every_pattern_and_reward_writes_a_script_that_trains_a_step(tmp_path: Path, tiny_model_dir: Path,
                                                                     request: pytest.FixtureRequest, pattern: str,
                                                                     reward: str, agent: str | None) -> None:
    own_backend = (pattern, reward, agent) == OWN_BACKEND
    # served names are unique on one backend: each script its own on the shared one
    name = "agent-001" if own_backend else f"wizard-{pattern}-{reward}" + ("-llamaindex" if agent else "")
    flags = ["--pattern", pattern, "--reward", reward, "--model", str(tiny_model_dir), "--name", name, *ONE_STEP]
    if agent:
        flags += ["--agent", agent, "--framework", "llamaindex"]
    written = subprocess.run([*WIZARD, str(tmp_path / "train.py"), "--yes", *flags], capture_output=True,
                             text=True, cwd=REPO, env=_env())
    assert written.returncode == 0, written.stderr
    script = tmp_path / "train.py"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(["train.py", "train_scenarios.jsonl"] + (["train_agent.py"] if pattern == "agent"
                                                                   and not agent else []))
    assert script.read_text().startswith('"""') and "python train.py" in script.read_text().split('"""')[1]
    _lint(tmp_path)

    if reward == "programmatic":  # edited as its user would: the tiny model never names a capital
        text = script.read_text()
        check = '    answer, last = scenario.get("answer"), (replies[-1] if replies else "")\n'
        assert check in text and text.count("\ndef reward(") == 1
        # random, not read from the replies: two rollouts that both stop at max_tokens can read alike
        text = text.replace("\ndef reward(", "\nimport random\n\n\ndef reward(")
        script.write_text(text.replace(check, "    return random.random()  # a reward that varies\n" + check))
    if own_backend:
        command, art_dir = [sys.executable, "train.py"], tmp_path / ".art"
    else:
        server = request.getfixturevalue("tiny_training_server")
        command, art_dir = [sys.executable, "train.py", "--backend-url", server.base_url], server.art_dir
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "held-out score of the base model: " in run.stdout
    assert "step 1/1: reward mean " in run.stdout and "checkpoint " in run.stdout
    assert f"Trained model: {name} (step " in run.stdout and "curl http://127.0.0.1:" in run.stdout
    history = [json.loads(line) for line in
               (art_dir / "my-project" / "models" / name / "history.jsonl").read_text().splitlines()]
    assert [h["split"] for h in history if h.get("split") == "val"] == ["val", "val"]  # before and after
    # RULER's judge (the tiny model) scores each group or fails on it, which drops the group: both run through
    assert ("after_each=score_group" in script.read_text()) == (reward == "ruler")

    assert "checkpoint 1" in run.stdout  # a step, even where a judge dropped the group
    if reward == "programmatic":
        assert "groups trained 1/1" in run.stdout  # the random reward gives the group signal
    if not own_backend:
        return
    # run again with --serve: it resumes with nothing left to train, then serves the model until Ctrl-C
    again = subprocess.Popen([sys.executable, "train.py", "--serve"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=_env())
    try:
        printed = []
        for line in again.stdout or ():
            printed.append(line)
            if line.startswith("Inference URL: "):
                break
        assert printed and "(served until Ctrl-C)" in printed[-1], "".join(printed)[-3000:]
        client = openai.OpenAI(base_url=printed[-1].split()[2], api_key="unused")
        reply = client.chat.completions.create(model="agent-001", max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].finish_reason in ("stop", "length")
        again.send_signal(signal.SIGINT)
        rest, _ = again.communicate(timeout=120)
    finally:
        if again.poll() is None:
            again.kill()
    assert again.returncode == 0 and rest.rstrip().endswith("stopped"), rest[-3000:]
    assert "step 1/1: reward mean" not in "".join(printed)


def test_the_interactive_flow_asks_again_with_the_reason(tmp_path: Path) -> None:
    terminal = pexpect.spawn(WIZARD[0], [*WIZARD[1:], "agent.py"], cwd=str(tmp_path), env=_env(),
                             encoding="utf-8", timeout=60)
    answers = [
        ("How does the model act", "dialogue", "is not one of: single-turn, multi-turn, tools, agent"),
        (None, "tools", None),
        ("What is the task", "", None),
        ("The system prompt", "Use the tool, then answer.", None),
        ("Scenarios", "nowhere.jsonl", "does not exist"),
        (None, "", None),
        ("Tools", "nowhere.json", "does not exist"),
        (None, "none", None),
        ("Most model turns", "0", "too small: at least 1"),
        (None, "3", None),
        ("Reward", "ruler", None),
        ("RULER's judge model", "", None),
        ("Base model", str(tmp_path), "is not a local model directory"),
        (None, "", None),
        ("Project name", "../up", "is not a name"),
        (None, "capitals", None),
        ("Model (run) name", "", None),
        ("Learning rate", "fast", "is not a number"),
        (None, "2e-4", None),
        ("Training steps", "", None),
        ("Rollouts per group", "1", "too small: at least 2"),
        (None, "", None),
        ("Groups (scenarios) per step", "", None),
        ("Scenarios held out", "", None),
    ]
    for prompt, typed, complaint in answers:
        if prompt is not None:
            terminal.expect_exact(prompt)
        terminal.expect_exact("]: ")
        terminal.sendline(typed)
        if complaint is not None:
            terminal.expect_exact(complaint)
    terminal.expect_exact("wrote agent.py")
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert terminal.exitstatus == 0
    text = (tmp_path / "agent.py").read_text()
    ast.parse(text)
    assert "MAX_TURNS = 3" in text and "LEARNING_RATE = 0.0002" in text and "PROJECT = 'capitals'" in text
    assert "ROLLOUTS_PER_GROUP = 16" in text and "SYSTEM_PROMPT = 'Use the tool, then answer.'" in text
    assert "def lookup_capital(" in text and "after_each=score_group" in text

    # asked before an existing file is overwritten; "no" keeps it
    before = text
    terminal = pexpect.spawn(WIZARD[0], [*WIZARD[1:], "agent.py", "--yes"], cwd=str(tmp_path), env=_env(),
                             encoding="utf-8", timeout=60)
    terminal.expect(pexpect.EOF)
    terminal.close()
    assert terminal.exitstatus != 0 and "agent.py exists: not overwritten" in terminal.before
    flags = [f"--{key}={value}" for key, value in [
        ("pattern", "single-turn"), ("task", "t"), ("system-prompt", "s"), ("scenarios", "agent_scenarios.jsonl"),
        ("reward", "programmatic"), ("model", "none"), ("project", "p"), ("name", "n"), ("learning-rate", "1e-4"),
        ("steps", "1"), ("rollouts", "2"), ("groups-per-step", "1"), ("held-out", "1")]]
    terminal = pexpect.spawn(WIZARD[0], [*WIZARD[1:], "agent.py", *flags], cwd=str(tmp_path), env=_env(),
                             encoding="utf-8", timeout=60)
    terminal.expect_exact("agent.py exists. Overwrite it? [y/N]: ")
    terminal.sendline("")
    terminal.expect_exact("kept agent.py as it is")
    terminal.expect(pexpect.EOF)
    assert (tmp_path / "agent.py").read_text() == before


@pytest.mark.parametrize(("flags", "says"), [
    (["--steps", "0"], "--steps: 0 is too small: at least 1"),
    (["--pattern", "chat"], "--pattern: 'chat' is not one of"),
    (["--name", "a/b"], "--name: 'a/b' is not a name"),
    (["--model", "/no/such/model"], "--model: '/no/such/model' is not a local model directory"),
    (["--pattern", "agent", "--agent", "no_such_module:build"], "--agent: module 'no_such_module' is not found"),
    (["--pattern", "agent", "--agent", "just_a_module"], "--agent: 'just_a_module' is not module:function"),
    (["--pattern", "tools", "--tools", "TOOLS"], "--tools: TOOLS: the parameters of 'f' must be a JSON schema of type"),
    (["--pattern", "tools", "--tools", "PROPERTIES"], "--tools: PROPERTIES: the \"properties\" of 'f' must map"),
    (["--pattern", "tools", "--tools", "REQUIRED"], "--tools: REQUIRED: the \"required\" of 'f' must list names from"),
    (["--scenarios", "SCENARIOS"], "--scenarios: SCENARIOS line 1 has no \"prompt\" string"),
])
def test_bad_flags_are_refused_by_name(tmp_path: Path, flags: list[str], says: str) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]))
    bad_properties, bad_required = tmp_path / "properties.json", tmp_path / "required.json"
    bad_properties.write_text(json.dumps([{"name": "f", "parameters": {"type": "object", "properties": 5}}]))
    bad_required.write_text(json.dumps([{"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["town"]}}]))
    scenarios = tmp_path / "scenarios.jsonl"
    scenarios.write_text('{"question": "?"}\n{"prompt": "p"}\n')
    files = {"TOOLS": tools, "PROPERTIES": bad_properties, "REQUIRED": bad_required, "SCENARIOS": scenarios}
    flags = [str(files[flag]) if flag in files else flag for flag in flags]
    for placeholder, path in files.items():
        says = says.replace(placeholder, str(path))
    with pytest.raises(SystemExit) as refused:
        main(["init", str(tmp_path / "train.py"), "--yes", *flags])
    assert says in str(refused.value)
    assert not (tmp_path / "train.py").exists()


def test_nothing_is_written_when_one_of_the_files_exists(tmp_path: Path) -> None:
    scenarios = tmp_path / "train_scenarios.jsonl"
    scenarios.write_text("mine\n")
    with pytest.raises(SystemExit) as refused:
        main(["init", str(tmp_path / "train.py"), "--yes"])
    assert f"{scenarios} exists: not overwritten" in str(refused.value)
    assert not (tmp_path / "train.py").exists() and scenarios.read_text() == "mine\n"
