"""The LlamaIndex example: its task and reward, the tools, a captured FunctionAgent rollout,
one tiny training step, and the evaluation table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory

from examples.llamaindex_agent.agent import SYSTEM_PROMPT, TOOLS, convert_length, convert_temperature, convert_weight
from examples.llamaindex_agent.rollout import rollout
from examples.llamaindex_agent.task import Scenario, convert, format_number, scenarios, score
from examples.runner import Policy
from tests.conftest import ServerThread, run_example, training_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")


def test_scenarios_are_reproducible_and_held_out_values_are_never_trained_on() -> None:
    train, val = scenarios("train", 60, seed=0), scenarios("val", 20, seed=0)
    assert train == scenarios("train", 60, seed=0) and train != scenarios("train", 60, seed=1)
    assert all(2 <= s.value < 60 for s in train) and all(60 <= s.value < 100 for s in val)
    assert {s.tool for s in train} == {"convert_length", "convert_weight", "convert_temperature"}
    assert all(str(s.value) in s.question for s in train + val)


def test_conversions_and_the_tools_that_print_them() -> None:
    assert format_number(convert("length", 7, "inch", "centimetre")) == "17.78"
    assert format_number(convert("weight", 5, "kilogram", "pound")) == "11.02"
    assert format_number(convert("temperature", 30, "celsius", "fahrenheit")) == "86"
    assert format_number(convert("temperature", 212, "fahrenheit", "celsius")) == "100"
    assert convert_length(7.0, "inch", "centimetre") == "7 inch = 17.78 centimetre"
    assert convert_weight(16, "ounce", "pound") == "16 ounce = 1 pound"
    assert convert_temperature(-40, "celsius", "fahrenheit") == "-40 celsius = -40 fahrenheit"
    # the units reach the model as enums in the tool schema, so the backend's grammar spells them
    schema = TOOLS[0].metadata.get_parameters_dict()
    assert schema["properties"]["from_unit"]["enum"][:3] == ["millimetre", "centimetre", "metre"]


def test_reward_gives_partial_credit_per_part() -> None:
    inches = Scenario("t", "How many centimetres are 7 inches?", "length", 7, "inch", "centimetre")
    assert inches.tool == "convert_length" and inches.answer == "17.78"
    call = ("convert_length", {"value": 7.0, "from_unit": "inch", "to_unit": "centimetre"})
    assert score(inches, [call], "7 inches are 17.78 centimetres.") == {
        "right_tool": 1.0, "right_value": 1.0, "right_units": 1.0, "has_number": 1.0, "plain": 1.0,
        "reward": pytest.approx(1.0)}
    wrong_units = ("convert_length", {"value": 7, "from_unit": "millimetre", "to_unit": "centimetre"})
    echoed = score(inches, [wrong_units], "<tool_response>\n7 millimetre = 0.7 centimetre\n</tool_response>")
    assert echoed["right_units"] == 0.5 and echoed["reward"] == pytest.approx(0.5)
    assert score(inches, [], "")["reward"] == 0.0


async def test_a_rollout_captures_the_function_agent(server: ServerThread) -> None:
    policy = Policy(f"{server.base_url}/v1", "SmolLM2-135M-Instruct", temperature=0)
    scenario = scenarios("val", 1, seed=0)[0]
    trajectory = await rollout(policy, scenario)

    messages = trajectory.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == SYSTEM_PROMPT and messages[1]["content"] == scenario.question
    (call,) = messages[2]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] in {"convert_length", "convert_weight", "convert_temperature"}
    assert messages[3]["content"].startswith(f"{format_number(arguments['value'])} {arguments['from_unit']} = ")
    assert set(trajectory.metrics) == {"model_calls", "right_tool", "right_value", "right_units", "has_number", "plain"}
    assert trajectory.metrics["model_calls"] == 2 and not trajectory.additional_histories
    assert all(c.token_ids and c.prompt_token_ids for c in trajectory.choices())
    assert 0.0 <= trajectory.reward <= 1.0 and not trajectory.logs
    stats = TokenizeStats()
    assert len(tokenize_trajectory(trajectory, 1.0, "rollout", stats, 8192)) == 1 + stats.prefix_breaks


def test_llamaindex_example_trains_a_step_and_evaluates(tmp_path: Path, tiny_engine: Any) -> None:
    with training_server(tiny_engine, tmp_path) as backend:  # the job against `art-backend serve`
        out = run_example("examples.llamaindex_agent.train", "--backend-url", backend.base_url, "--steps", "1",
                          "--scenarios-per-step", "1", "--rollouts", "2", "--held-out", "2", "--art-dir", str(tmp_path))
        table = run_example("examples.llamaindex_agent.evaluate", "--backend-url", backend.base_url, "--art-dir",
                            str(tmp_path), "--held-out", "2", "--models", "tiny-random-smollm2", "units-agent-s0")
    assert "base model held-out score (step 0)" in out and "held-out score: base" in out
    step = next(line for line in out.splitlines() if line.startswith("step "))  # step 0/1 if nothing to learn
    assert "right_units" in step and " sequences, groups trained " in step
    model_dir = tmp_path / "llamaindex-units" / "models" / "units-agent-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000 and (model_dir / "history.jsonl").is_file()
    assert "held-out score" in table and "right_units" in table and "units-agent-s0" in table
