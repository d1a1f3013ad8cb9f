"""SFT from a file (ART 0.5.23's `art.utils.sft`): `train_sft_from_file(model, path, epochs, ...)` over
OpenAI's chat fine-tuning JSONL, one conversation a line:

    {"messages": [{"role": "user", "content": "..."},
                  {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "search", "arguments": "{\\"q\\": \\"...\\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "..."},
                  {"role": "assistant", "content": "..."}],
     "tools": [{"type": "function", "function": {"name": "search", "parameters": {...}}}]}

Every line is checked before anything trains (`read_sft_file`): a file with one bad line is
refused whole, each bad line named by its number with what is wrong and how to write it. An
assistant message may carry OpenAI's `"weight": 0` (shown, not trained).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from art_integrations.training import TrainResult, TrainSFTConfig
from art_integrations.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_integrations.model import TrainableModel

_LINE_KEYS = {"messages", "tools", "parallel_tool_calls"}
_MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "weight", "reasoning_content"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_CALL_SHAPE = ('{"id": "call_1", "type": "function", "function": {"name": "...", '
               '"arguments": "{\\"key\\": \\"value\\"}"}}')
_TOOL_SHAPE = '{"type": "function", "function": {"name": "...", "parameters": {"type": "object", ...}}}'
_SHOWN_ERRORS = 10  # a file refused for many lines names the first few


class SFTFileError(ValueError):
    """A file of demonstrations that cannot be trained on; nothing was trained."""


class _Bad(ValueError):
    """One line's problem: what is wrong, and the fix."""


def _text_content(content: Any, where: str, optional: bool) -> bool:
    """Checks a message's content; whether it has any."""
    if content is None:
        if optional:
            return False
        raise _Bad(f"{where} has no content: give it a string")
    if isinstance(content, str):
        return bool(content)
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return any(p["text"] for p in content)
    raise _Bad(f"{where}.content must be a string (or a list of {{\"type\": \"text\", \"text\": ...}} parts), "
               f"got {json.dumps(content)[:80]}")


def _check_call(call: Any, where: str, tool_names: set[str] | None) -> str:
    """Checks one assistant tool call; its id."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(call.get("id"), str) or not call["id"]:
        raise _Bad(f"{where} must look like {_CALL_SHAPE}, got {json.dumps(call)[:120]}")
    if call.get("type", "function") != "function":
        raise _Bad(f"{where}.type is {call['type']!r}: only \"function\" calls are trained")
    name, arguments = function.get("name"), function.get("arguments")
    if not isinstance(name, str) or not name:
        raise _Bad(f"{where}.function.name must be the called function's name (a non-empty string)")
    if tool_names is not None and name not in tool_names:
        raise _Bad(f"{where} calls {name!r}, which `tools` does not define: add it to `tools` or fix the name")
    if not isinstance(arguments, str):
        raise _Bad(f"{where}.function.arguments must be a string of JSON (OpenAI's format), got "
                   f"{type(arguments).__name__}: write it as json.dumps(arguments)")
    try:
        decoded = json.loads(arguments)
    except json.JSONDecodeError as error:
        raise _Bad(f"{where}.function.arguments is not valid JSON ({error.msg} at character {error.pos + 1}): "
                   f"{arguments[:80]!r}") from None
    if not isinstance(decoded, dict):
        raise _Bad(f"{where}.function.arguments must encode a JSON object, got {arguments[:80]!r}")
    return call["id"]


def _check_tools(tools: Any) -> set[str] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _Bad(f"`tools` must be a list of {_TOOL_SHAPE}")
    names: set[str] = set()
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(function, dict) or tool.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not function["name"]):
            raise _Bad(f"tools[{j}] must look like {_TOOL_SHAPE}, got {json.dumps(tool)[:120]}")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict) or parameters.get("type", "object") != "object"):
            raise _Bad(f"tools[{j}].function.parameters must be a JSON schema of type object")
        if function["name"] in names:
            raise _Bad(f"tools[{j}] defines {function['name']!r} a second time: function names must be distinct")
        names.add(function["name"])
    return names


def _check_message(message: Any, where: str, tool_names: set[str] | None, called: set[str]) -> bool:
    """Checks one message; whether it is an assistant turn to train on."""
    if not isinstance(message, dict):
        raise _Bad(f"{where} must be an object with a role and content, got {json.dumps(message)[:80]}")
    role = message.get("role")
    if role not in _ROLES:
        hint = " (OpenAI's legacy function role: write it as a tool message with tool_call_id)" if role == "function" else ""
        raise _Bad(f"{where} has role {role!r}{hint}: use one of {', '.join(_ROLES)}")
    unknown = sorted(set(message) - _MESSAGE_KEYS)
    if unknown:
        raise _Bad(f"{where} has {', '.join(map(repr, unknown))}, which this format does not have: a message takes "
                   f"{', '.join(sorted(_MESSAGE_KEYS))}")
    if "weight" in message and (role != "assistant" or message["weight"] not in (0, 1)
                                or isinstance(message["weight"], bool)):
        raise _Bad(f"{where}.weight: only assistant messages take a weight, 0 (not trained) or 1")
    if role != "assistant":
        if "tool_calls" in message:
            raise _Bad(f"{where} is a {role} message with tool_calls: only assistant messages make calls")
        _text_content(message.get("content"), where, optional=False)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in called:
                raise _Bad(f"{where} is a tool result for call {call_id!r}, which no earlier assistant message made: "
                           "give it the `id` of that call as `tool_call_id`")
        return False
    calls = message.get("tool_calls")
    if calls is not None and (not isinstance(calls, list) or not calls):
        raise _Bad(f"{where}.tool_calls must be a non-empty list of {_CALL_SHAPE} (or left out)")
    for k, call in enumerate(calls or ()):
        called.add(_check_call(call, f"{where}.tool_calls[{k}]", tool_names))
    if not _text_content(message.get("content"), where, optional=True) and not calls:
        raise _Bad(f"{where} is an assistant message with neither content nor tool_calls: nothing to learn from")
    return message.get("weight", 1) != 0


def parse_sft_line(line: str) -> Trajectory:
    """One line of the file as a Trajectory (messages without token ids); `_Bad` says why not."""
    try:
        data = json.loads(line.strip())
    except json.JSONDecodeError as error:
        raise _Bad(f"not JSON ({error.msg} at character {error.pos + 1}): each line must be one JSON object, "
                   "{\"messages\": [...]}") from None
    if not isinstance(data, dict):
        raise _Bad(f"a JSON {type(data).__name__}, not an object: each line must be {{\"messages\": [...]}}")
    if "functions" in data:
        raise _Bad("`functions` is OpenAI's legacy format: give `tools` ([{\"type\": \"function\", \"function\": "
                   "{...}}]) and assistant `tool_calls` instead")
    unknown = sorted(set(data) - _LINE_KEYS)
    if unknown:
        raise _Bad(f"unknown key {', '.join(map(repr, unknown))}: a line takes {', '.join(sorted(_LINE_KEYS))}")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Bad("no `messages`: each line must be {\"messages\": [{\"role\": ..., \"content\": ...}, ...]}")
    tool_names = _check_tools(data.get("tools"))
    called: set[str] = set()
    trained = [_check_message(m, f"messages[{i}]", tool_names, called) for i, m in enumerate(messages)]
    if not any(trained):
        raise _Bad("no assistant message to learn from: add the assistant's reply (one without \"weight\": 0)")
    if messages[0].get("role") == "assistant":
        raise _Bad("messages[0] is an assistant message, which answers nothing: start with a system or user message")
    return Trajectory(messages_and_choices=messages, tools=data.get("tools"))


def read_sft_file(file_path: str | Path) -> list[Trajectory]:
    """Every conversation of a JSONL file, each line checked; raises `SFTFileError` naming every
    bad line (the first few) if any line is bad. Blank lines are skipped."""
    path = Path(file_path)
    if path.suffix != ".jsonl":
        raise SFTFileError(f"{path}: only JSONL files are read (one JSON object a line, named *.jsonl)")
    trajectories: list[Trajectory] = []
    problems: list[str] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                trajectories.append(parse_sft_line(line))
            except _Bad as error:
                problems.append(f"line {number}: {error}")
    if problems:
        shown = "\n  ".join(problems[:_SHOWN_ERRORS])
        more = f"\n  ... and {len(problems) - _SHOWN_ERRORS} more" if len(problems) > _SHOWN_ERRORS else ""
        raise SFTFileError(f"{path}: {len(problems)} of its lines cannot be trained on, so nothing was trained:"
                           f"\n  {shown}{more}")
    return trajectories


def get_file_row_count(file_path: str) -> int:
    """Non-blank lines of a JSONL file (ART's)."""
    if not str(file_path).endswith(".jsonl"):
        raise ValueError(f"Only JSONL files are supported. Got: {file_path}")
    with open(file_path, encoding="utf-8") as lines:
        return sum(1 for line in lines if line.strip())


def create_lr_schedule(total_steps: int, peak_lr: float, method: Literal["cosine", "linear", "constant"] = "linear",
                       warmup_steps: int = 0, min_lr: float = 0.0) -> list[float]:
    """A learning rate per batch (ART's): a linear warmup from min_lr to peak_lr over
    `warmup_steps` (its first step already above min_lr), then cosine, linear or no decay to min_lr
    on the last step."""
    if method not in ("cosine", "linear", "constant"):
        raise ValueError(f"Unknown method: {method}. Choose from: cosine, linear, constant")
    decay_steps = total_steps - warmup_steps
    rates = []
    for step in range(max(total_steps, 0)):
        if step < warmup_steps:
            rates.append(min_lr + (peak_lr - min_lr) * ((step + 1) / warmup_steps))  # ART's order: its floats
            continue
        progress = (step - warmup_steps) / (decay_steps - 1) if decay_steps > 1 else 0.0
        if method == "cosine":
            rates.append(min_lr + (peak_lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress)))
        elif method == "linear":
            rates.append(peak_lr - (peak_lr - min_lr) * progress)
        else:
            rates.append(peak_lr)
    return rates


def _shuffled(items: list[Trajectory], rng: random.Random, buffer_size: int) -> Iterator[Trajectory]:
    """ART's streaming shuffle: once the buffer is full, a random one of it goes out per item in;
    the rest leave shuffled at the end (a file shorter than the buffer: a plain shuffle)."""
    buffer: list[Trajectory] = []
    for item in items:
        buffer.append(item)
        if len(buffer) >= buffer_size:
            yield buffer.pop(rng.randint(0, len(buffer) - 1))
    rng.shuffle(buffer)
    yield from buffer


def iterate_file(file_path: str, epochs: int = 1, shuffle_buffer_size: int = 10000, seed: int = 42,
                 initial_skip: int = 0) -> Iterator[Trajectory]:
    """The file's conversations for `epochs` epochs, each shuffled with seed + epoch (ART's order),
    the first `initial_skip` left out. The whole file is checked first (`read_sft_file`)."""
    rows = read_sft_file(file_path)
    skipped = 0
    for epoch in range(epochs):
        for trajectory in _shuffled(rows, random.Random(seed + epoch), shuffle_buffer_size):
            if skipped < initial_skip:
                skipped += 1
                continue
            yield trajectory


async def train_sft_from_file(model: TrainableModel, file_path: str, epochs: int = 1, batch_size: int = 2,
                              peak_lr: float = 2e-4,
                              schedule_type: Literal["cosine", "linear", "constant"] = "linear",
                              warmup_ratio: float = 0.1, initial_step: int = 0, final_step: int | None = None,
                              _config: dict[str, Any] | None = None, verbose: bool = False,
                              shuffle_buffer_size: int = 10000, log_metrics: bool = True,
                              assistant_turns: Literal["all", "last"] = "all") -> TrainResult | None:
    """SFT on a JSONL file of conversations (ART 0.5.23's arguments): one `model.train_sft` step
    (one checkpoint) over `epochs` passes of the shuffled file in batches of `batch_size`, the
    learning rate following `schedule_type` from a warmup of `warmup_ratio` of the batches up to
    `peak_lr`. `initial_step` and `final_step` (batches) train a slice of that schedule, to resume
    or to evaluate between segments. Every line is checked first; a bad one refuses the whole
    file (`SFTFileError`) and nothing trains. None when there is nothing to train."""
    rows = read_sft_file(file_path)
    if verbose:
        print(f"File has {len(rows)} rows")
    total = len(rows) * epochs
    skip = initial_step * batch_size
    if total == 0 or skip >= total:
        return None
    total_batches = math.ceil(total / batch_size)
    schedule = create_lr_schedule(total_batches, peak_lr, schedule_type, int(total_batches * warmup_ratio))
    rates = schedule[initial_step:min(final_step, total_batches) if final_step is not None else None]
    if not rates:
        return None
    chosen: list[Trajectory] = []
    for epoch in range(epochs):
        chosen += _shuffled(rows, random.Random(42 + epoch), shuffle_buffer_size)
    chosen = chosen[skip:skip + len(rates) * batch_size]
    if verbose:
        print(f"Training {len(chosen)} trajectories in {len(rates)} batches of {batch_size}, {schedule_type} "
              f"schedule up to {peak_lr}")
    config = TrainSFTConfig(learning_rate=rates, batch_size=batch_size, assistant_turns=assistant_turns)
    return await model.train_sft(chosen, config, _config=_config, verbose=verbose, log_metrics=log_metrics)


def best_of_groups(groups: Iterable[TrajectoryGroup], min_reward: float | None = None) -> list[Trajectory]:
    """Rejection sampling's fine-tuning data, `await model.train_sft(best_of_groups(groups))`: each
    scored group's best trajectory (the first of equals). Without `min_reward`, a group whose
    trajectories all scored alike has none better than the rest and gives none; with it, a group
    gives its best exactly when that reaches `min_reward` (so a group where every rollout failed
    gives none, and one where all succeeded gives one)."""
    best: list[Trajectory] = []
    for group in groups:
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"best_of_groups takes TrajectoryGroup objects, not {type(group).__name__}: "
                            "pass the scored groups, e.g. from gather_trajectory_groups")
        rewards = [trajectory.reward for trajectory in group.trajectories]
        if not rewards or (max(rewards) == min(rewards) if min_reward is None else max(rewards) < min_reward):
            continue
        best.append(group.trajectories[rewards.index(max(rewards))])
    return best
