"""The supervisor example: its task and reward, a rollout whose sub-agent becomes an additional
history that trains as its own sequence, one tiny training step, and the evaluation table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory

from art_integrations import Choice, History, Trajectory
from examples.runner import Policy
from examples.supervisor.agent import RESEARCH_QUESTIONS, RESEARCHER_PROMPT, SUPERVISOR_PROMPT
from examples.supervisor.rollout import rollout, sub_agent_histories, tool_calls
from examples.supervisor.task import PRODUCTS, Scenario, fact, scenarios, score
from tests.conftest import ServerThread, run_example, training_server

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")


def test_scenarios_are_reproducible_and_held_out_products_are_never_trained_on() -> None:
    train, val = scenarios("train", 50, seed=0), scenarios("val", 20, seed=0)
    assert train == scenarios("train", 50, seed=0) and train != scenarios("train", 50, seed=1)
    assert {s.product for s in train} <= set(PRODUCTS[:14]) and {s.product for s in val} <= set(PRODUCTS[14:])
    assert {s.tool for s in train} == {"get_price", "get_stock", "get_delivery_days"}
    assert {(s.tool, s.topic) for s in train} == {("get_price", "price"), ("get_stock", "stock"),
                                                  ("get_delivery_days", "delivery")}
    assert all(s.product in s.question for s in train + val)


def test_catalogue_facts_and_the_number_an_answer_must_carry() -> None:
    kettle = Scenario("t", "How much does the blue kettle cost?", "get_price", "blue kettle")
    assert kettle.answer == fact("get_price", "blue kettle") == "35.50 EUR" and kettle.number == "35.50"
    assert fact("get_stock", "blue kettle") == "77 units in stock"
    assert Scenario("t", "", "get_delivery_days", "blue kettle").number == "3"


def test_reward_gives_partial_credit_per_agent_part() -> None:
    kettle = Scenario("t", "How much does the blue kettle cost?", "get_price", "blue kettle")
    request = {"product": "blue kettle", "topic": "price"}
    perfect = score(kettle, [request], [("get_price", {"product": "blue kettle"})], "The blue kettle costs 35.50 EUR.")
    assert perfect == {"right_request": 1.0, "right_lookup": 1.0, "has_number": 1.0, "plain": 1.0,
                       "reward": pytest.approx(1.0)}
    # asked about the right product's stock, the sub-agent looked up another product; markup echoed
    partial = score(kettle, [{"product": "blue kettle", "topic": "stock"}], [("get_stock", {"product": "red lamp"})],
                    "<tool_response>35.50</tool_response>")
    assert (partial["right_request"], partial["right_lookup"], partial["plain"]) == (0.5, 0.0, 0.0)
    assert partial["reward"] == pytest.approx(0.1 + 0.3)
    # plain words without the number earn nothing for the answer
    assert score(kettle, [request], [], "It is a lovely kettle.")["reward"] == pytest.approx(0.2)
    assert score(kettle, [], [], "")["reward"] == 0.0  # never delegated, never answered


def test_sub_agent_calls_are_read_from_its_additional_history() -> None:
    def history(tool: str, product: str) -> History:
        call = {"id": "c1", "type": "function", "function": {"name": tool, "arguments": f'{{"product": "{product}"}}'}}
        return History(messages_and_choices=[{"role": "user", "content": "q"},
                                             Choice(message={"role": "assistant", "tool_calls": [call]})])

    trajectory = Trajectory(additional_histories=[history("get_stock", "red lamp"), history("get_price", "tan bench")],
                            metadata={"additional_history_agents": ["main", "research"]})  # a branch, the sub-agent
    (research,) = sub_agent_histories(trajectory)
    assert tool_calls(research) == [("get_price", {"product": "tan bench"})]


async def test_a_rollout_trains_the_sub_agent_as_an_additional_history(server: ServerThread) -> None:
    policy = Policy(f"{server.base_url}/v1", "SmolLM2-135M-Instruct", temperature=0)
    scenario = scenarios("val", 1, seed=0)[0]
    trajectory = await rollout(policy, scenario)

    assert trajectory.messages()[0] == {"role": "system", "content": SUPERVISOR_PROMPT}
    assert trajectory.messages()[1] == {"role": "user", "content": scenario.question}
    delegation = trajectory.choices()[0].message["tool_calls"][0]["function"]
    assert delegation["name"] == "ask_researcher"
    (research,) = trajectory.additional_histories
    assert trajectory.metadata["additional_history_agents"] == ["research"]
    assert research.messages()[0] == {"role": "system", "content": RESEARCHER_PROMPT}
    request = json.loads(delegation["arguments"])
    assert research.messages()[1]["content"] == RESEARCH_QUESTIONS[request["topic"]].format(product=request["product"])
    (lookup,) = tool_calls(research)
    assert lookup[0] in {"get_price", "get_stock", "get_delivery_days"} and lookup[1]["product"] in PRODUCTS
    assert trajectory.metrics["sub_agent_calls"] == 1 and trajectory.metrics["sub_agent_histories"] == 1
    assert trajectory.metrics["model_calls"] == 3  # delegate, look up, answer
    assert all(c.token_ids and c.prompt_token_ids for h in trajectory.histories() for c in h.choices())
    assert 0.0 <= trajectory.reward <= 1.0 and not trajectory.logs

    # the sub-agent's conversation trains as one more sequence;
    # a turn re-rendered to other tokens than sampled starts a new sequence, counted as a prefix break
    stats, main_only = TokenizeStats(), TokenizeStats()
    sequences = tokenize_trajectory(trajectory, 1.0, "rollout", stats, 8192)
    supervisor_only = trajectory.model_copy(update={"additional_histories": []})
    assert len(sequences) - len(tokenize_trajectory(supervisor_only, 1.0, "main", main_only, 8192)) == 1
    assert len(sequences) == 2 + stats.prefix_breaks and stats.prefix_breaks == main_only.prefix_breaks


def test_supervisor_example_trains_a_step_and_evaluates(tmp_path: Path, tiny_engine: Any) -> None:
    with training_server(tiny_engine, tmp_path) as backend:  # the job against `art-backend serve`
        out = run_example("examples.supervisor.train", "--backend-url", backend.base_url, "--steps", "1",
                          "--scenarios-per-step", "1", "--rollouts", "2", "--held-out", "2", "--art-dir", str(tmp_path))
        table = run_example("examples.supervisor.evaluate", "--backend-url", backend.base_url, "--art-dir",
                            str(tmp_path), "--held-out", "2", "--models", "tiny-random-smollm2", "shop-supervisor-s0")
    assert "base model held-out score (step 0)" in out and "held-out score: base" in out
    step = next(line for line in out.splitlines() if line.startswith("step "))  # step 0/1 if nothing to learn
    assert "sub_agent_histories" in step and " sequences, groups trained " in step
    model_dir = tmp_path / "supervisor" / "models" / "shop-supervisor-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000 and (model_dir / "history.jsonl").is_file()
    assert "held-out score" in table and "sub_agent_histories" in table and "shop-supervisor-s0" in table
