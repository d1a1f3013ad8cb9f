"""The wizard's questions: each with its flag, its default, and a check that says what is wrong.

`Question.check` turns a typed answer into its value or raises `ValueError` with the reason,
which the terminal shows before asking again (and a bad flag value stops the run with it).
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PATTERNS = ("single-turn", "multi-turn", "tools", "agent")
REWARDS = ("programmatic", "ruler")
FRAMEWORKS = ("langgraph", "llamaindex")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # the backend's rule for project and model names
_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


@dataclass(frozen=True)
class Question:
    key: str  # the answer's name; its flag is --key with dashes
    prompt: str
    default: Callable[[dict[str, Any]], Any]  # from the answers so far
    check: Callable[[str], Any]
    applies: Callable[[dict[str, Any]], bool] = lambda answers: True

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")


def choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in options:
            raise ValueError(f"{text!r} is not one of: {', '.join(options)}")
        return text
    return check


def plain_name(text: str) -> str:
    if not _NAME.fullmatch(text):
        raise ValueError(f"{text!r} is not a name: use letters, digits, '.', '_' and '-', starting with a letter "
                         "or digit, at most 100 characters")
    return text


def text(what: str) -> Callable[[str], str]:
    def check(value: str) -> str:
        if not value.strip():
            raise ValueError(f"{what} cannot be empty")
        return value.strip()
    return check


def positive_int(minimum: int = 1) -> Callable[[str], int]:
    def check(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{value!r} is not a whole number") from None
        if number < minimum:
            raise ValueError(f"{number} is too small: at least {minimum}")
        return number
    return check


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number (e.g. 1e-4)") from None
    if not 0 < number < float("inf"):
        raise ValueError(f"{value} must be a positive number")
    return number


def optional(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """`check`, with "none" (or nothing) meaning no value."""
    def checked(value: str) -> Any:
        return None if value.strip().lower() in ("", "none") else check(value)
    return checked


def model_dir(value: str) -> str:
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{value!r} is not a local model directory (no config.json in it): give a directory a "
                         "Hugging Face model was downloaded or saved to, or 'none' for the embedded model")
    return str(path)


def scenarios_file(value: str) -> str:
    """A JSONL file of scenarios: one object per line with a "prompt" (and optionally "answer",
    "followups")."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value!r} does not exist: give a .jsonl file with one {{\"prompt\": ...}} per line")
    count = 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            scenario = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{value} line {number} is not JSON ({error.msg})") from None
        if not isinstance(scenario, dict) or not isinstance(scenario.get("prompt"), str):
            raise ValueError(f"{value} line {number} has no \"prompt\" string: each line is an object like "
                             "{\"prompt\": \"...\", \"answer\": \"...\"}")
        followups = scenario.get("followups", [])
        if not isinstance(followups, list) or not all(isinstance(f, str) for f in followups):
            raise ValueError(f"{value} line {number}: \"followups\" must be a list of strings")
        count += 1
    if count < 2:
        raise ValueError(f"{value} holds {count} scenario(s): training needs at least 2 (some are held out)")
    return str(path)


def tools_file(value: str) -> str:
    """A JSON file with a list of OpenAI tool definitions (or bare function definitions)."""
    path = Path(value).expanduser()
    if not path.is_file():
        raise ValueError(f"{value!r} does not exist: give a JSON file with a list of OpenAI tool definitions")
    try:
        tools = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{value} is not JSON ({error.msg} at line {error.lineno})") from None
    load_tools(tools, value)
    return str(path)


def load_tools(tools: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool definitions from `tools` (functions may be given bare), checked."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where} must hold a non-empty JSON list of tools")
    checked, names = [], set()
    for index, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}: tool {index} has no function name: each tool is "
                             "{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}")
        name = function["name"]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or name in names:
            raise ValueError(f"{where}: tool name {name!r} must be a distinct Python identifier (the script "
                             "writes a function of that name)")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ValueError(f"{where}: the parameters of {name!r} must be a JSON schema of type object")
        # The mistakes a hand-written schema makes, checked here (the client does not depend on
        # jsonschema); the backend checks the rest when it compiles the tool's grammar.
        properties, required = parameters.get("properties", {}), parameters.get("required", [])
        if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
            raise ValueError(f"{where}: the \"properties\" of {name!r} must map each argument to its JSON schema, "
                             "e.g. {\"city\": {\"type\": \"string\"}}")
        if not isinstance(required, list) or not all(isinstance(r, str) and r in properties for r in required):
            raise ValueError(f"{where}: the \"required\" of {name!r} must list names from its \"properties\" "
                             f"({', '.join(properties) or 'none'})")
        names.add(name)
        checked.append({"type": "function", "function": {**function, "parameters": parameters}})
    return checked


def agent_factory(value: str) -> str:
    """`module:function`, where the module can be found from the current directory."""
    if not _FACTORY.fullmatch(value):
        raise ValueError(f"{value!r} is not module:function (e.g. my_agent:build_agent): the function takes a "
                         "chat model (LangChain) or LLM (LlamaIndex) and returns the agent")
    module = value.split(":")[0]
    try:
        found = importlib.util.find_spec(module)  # imports the parent packages, which may fail
    except (ImportError, ValueError) as error:
        raise ValueError(f"module {module!r} cannot be looked up from here: {type(error).__name__}: {error}") from None
    if found is None:
        raise ValueError(f"module {module!r} is not found from here: run the wizard where the script will run, "
                         "or give the module as Python imports it")
    return value


QUESTIONS: list[Question] = [
    Question("pattern", "How does the model act? single-turn (one reply), multi-turn (a conversation), tools "
             "(a tool-calling loop), agent (I already have a LangGraph or LlamaIndex agent)",
             lambda a: "single-turn", choice(PATTERNS)),
    Question("agent", "Where is your agent built? module:function, taking a chat model / LLM (none: write an "
             "example LangGraph agent beside the script)", lambda a: None, optional(agent_factory),
             applies=lambda a: a["pattern"] == "agent"),
    Question("framework", "Which framework is it? langgraph or llamaindex", lambda a: "langgraph",
             choice(FRAMEWORKS), applies=lambda a: a["pattern"] == "agent" and a.get("agent") is not None),
    Question("task", "What is the task, in a sentence?", lambda a: "Answer questions about world capitals in one "
             "short sentence.", text("the task")),
    Question("system_prompt", "The system prompt", lambda a: a["task"], text("the system prompt")),
    Question("scenarios", "Scenarios: a .jsonl file, one {\"prompt\": ..., \"answer\": ...} per line (none: "
             "write 16 example ones beside the script)", lambda a: None, optional(scenarios_file)),
    Question("tools", "Tools: a JSON file with a list of OpenAI tool definitions (none: an example "
             "lookup_capital tool)", lambda a: None, optional(tools_file), applies=lambda a: a["pattern"] == "tools"),
    Question("max_turns", "Most model turns in an episode (it also ends when the model stops calling tools, or "
             "when the scenario's follow-ups run out)", lambda a: 4, positive_int(),
             applies=lambda a: a["pattern"] in ("multi-turn", "tools")),
    Question("reward", "Reward: programmatic (a function you write) or ruler (an LLM judge ranks each group)",
             lambda a: "programmatic", choice(REWARDS)),
    Question("judge_model", "RULER's judge model (none: the backend's own base model, so it runs offline; use a "
             "strong one for real training)", lambda a: None, optional(text("the judge model")),
             applies=lambda a: a["reward"] == "ruler"),
    Question("judge_base_url", "The judge's OpenAI-compatible URL", lambda a: "https://api.openai.com/v1",
             text("the URL"), applies=lambda a: a["reward"] == "ruler" and a.get("judge_model") is not None),
    Question("model", "Base model: a local model directory (none: the embedded SmolLM2-135M-Instruct)",
             lambda a: None, optional(model_dir)),
    Question("project", "Project name", lambda a: "my-project", plain_name),
    Question("name", "Model (run) name", lambda a: "agent-001", plain_name),
    Question("learning_rate", "Learning rate", lambda a: 1e-4, positive_float),
    Question("steps", "Training steps", lambda a: 10, positive_int()),
    Question("rollouts", "Rollouts per group", lambda a: 16 if a["reward"] == "ruler" else 4, positive_int(2)),
    Question("groups_per_step", "Groups (scenarios) per step", lambda a: 2, positive_int()),
    Question("held_out", "Scenarios held out for scoring", lambda a: 4, positive_int(0)),
]


def ask_all(flags: dict[str, Any], interactive: bool, read: Callable[[str], str] = input,
            say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every question that applies: from its flag when given (checked), else asked (with
    `interactive`; a bad answer is asked again with the reason) or its default."""
    answers: dict[str, Any] = {}
    for question in QUESTIONS:
        if not question.applies(answers):
            continue
        given = flags.get(question.key)
        if given is not None:
            try:
                answers[question.key] = question.check(str(given))
            except ValueError as error:
                raise SystemExit(f"{question.flag}: {error}") from None
            continue
        default = question.default(answers)
        if not interactive:
            answers[question.key] = default
            continue
        while True:
            typed = read(f"{question.prompt} [{'none' if default is None else default}]: ").strip()
            if not typed:
                answers[question.key] = default
                break
            try:
                answers[question.key] = question.check(typed)
                break
            except ValueError as error:
                say(f"  {error}")
    return answers
