"""The main job runs one tiny step end to end, resumes, and its evaluation prints a table; a seed
repeats a run."""

from __future__ import annotations

from pathlib import Path

import json
import subprocess
import sys

import pytest

from art_backend.engine.torch_engine import TorchEngine
from examples.city_facts.task import QUESTIONS, Scenario, scenarios, score
from examples.runner import Policy, no_signal_note, rollout_seed
from tests.conftest import run_example, training_server


def test_city_facts_main_job_runs_a_step_and_resumes(tmp_path: Path, tiny_engine: TorchEngine) -> None:
    args = ["--model", "tiny-random-smollm2", "--steps", "1", "--scenarios-per-step", "1", "--rollouts", "4",
            "--held-out", "2", "--art-dir", str(tmp_path)]
    out = run_example("examples.city_facts.train", *args)
    assert "base model held-out score (step 0)" in out
    assert "held-out score: base" in out
    model_dir = tmp_path / "city-facts" / "models" / "city-agent-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000
    assert (model_dir / "history.jsonl").is_file()
    assert (model_dir / "checkpoints" / "0001").is_dir()  # a step, even where the rollouts all scored alike
    trained = [json.loads(line) for line in (model_dir / "history.jsonl").read_text().splitlines()][1]
    assert trained["step"] == 1 and trained["scale_rewards"] is False  # the example's advantages, as trained
    # run again against a backend running elsewhere (`art-backend serve` on the same art dir, any engine):
    # it resumes with nothing left to train, and evaluates
    with training_server(tiny_engine, tmp_path) as running:
        again = run_example("examples.city_facts.train", *args[2:], "--backend-url", running.base_url)
        table = run_example("examples.city_facts.evaluate", "--backend-url", running.base_url, "--art-dir",
                            str(tmp_path), "--held-out", "2", "--models", "tiny-random-smollm2", "city-agent-s0")
        remote = run_example("examples.city_facts.evaluate", "--backend-url", running.base_url, "--held-out", "2")
    assert "base model held-out score (step 0, from history)" in again
    assert "step 1/1" not in again  # resumed: nothing left to train
    assert "held-out score" in table and "city-agent-s0" in table
    assert "tiny-random-smollm2" in remote and "city-agent-s0@" in remote


def test_city_facts_reward_credits_the_fact_in_plain_words_only() -> None:
    oslo = Scenario("t", "What time is it in Oslo?", "get_local_time", "Oslo", ("time",))
    assert oslo.answer == "6:50"
    call = [("get_local_time", {"city": "Oslo"})]
    assert score(oslo, call, "It is 6:50 in Oslo.") == {"right_tool": 1.0, "right_city": 1.0, "has_fact": 1.0,
                                                        "plain": 1.0, "reward": pytest.approx(1.0)}
    echoed = score(oslo, call, "<tool_response>\n6:50\n</tool_response>")
    assert echoed["has_fact"] == 1.0 and echoed["reward"] == pytest.approx(0.4)  # no more than the lookup itself
    # and dropping the markup along with the fact earns nothing over it either
    assert score(oslo, call, "You can use the get_local_time function.")["reward"] == pytest.approx(0.4)
    assert score(oslo, [("get_weather", {"city": "Rome"})], "")["reward"] == 0.0


def test_city_facts_reward_wants_the_part_of_the_fact_the_question_asks_for() -> None:
    bern = [("get_weather", {"city": "Bern"})]
    like, raining, warm = (next(s for s in scenarios("val", 54) if s.question == q.format(city="Bern"))
                           for q in QUESTIONS["get_weather"])
    assert raining.answer == "3 C, cloudy"
    assert score(raining, bern, "No, it is cloudy in Bern.")["reward"] == pytest.approx(1.0)
    assert score(raining, bern, "It is 3 degrees in Bern.")["reward"] == pytest.approx(0.4)  # not what was asked
    assert score(warm, bern, "It is 3 degrees in Bern.")["reward"] == pytest.approx(1.0)
    assert score(warm, bern, "It is cloudy in Bern.")["reward"] == pytest.approx(0.4)
    assert score(like, bern, "Cloudy.")["reward"] == score(like, bern, "3 C.")["reward"] == pytest.approx(1.0)
    rainy = Scenario("t", "Is it raining in Oslo right now?", "get_weather", "Oslo", ("sky",))
    assert rainy.answer.endswith("rainy") and rainy.answered_by("Yes, it is raining in Oslo.")


def test_city_facts_scenarios_take_the_tools_in_turn_and_repeat_none() -> None:
    held_out = scenarios("val", 12)
    assert [s.tool for s in held_out] == sorted(QUESTIONS) * 4  # each step of three trains every tool
    assert len({s.question for s in held_out}) == 12
    train = scenarios("train", 24, seed=3)
    assert len({s.question for s in train}) == 24 and not {s.city for s in train} & {s.city for s in held_out}
    assert scenarios("train", 24, seed=3) == train != scenarios("train", 24, seed=4)


def test_the_city_facts_experts_demonstrations_earn_full_marks_read_back_as_rollouts_are() -> None:
    """Each demonstration is the agent's conversation done right (`--sft-demos`): the task's own
    reward gives it full marks, its tool calls and answer read from LangChain messages as a rollout's are."""
    from langchain_core.messages import convert_to_messages

    from examples.city_facts.agent import SYSTEM_PROMPT, TOOLS
    from examples.city_facts.expert import demonstrations

    picked = scenarios("train", 27, seed=5)  # every question of every tool
    templates = [q for qs in QUESTIONS.values() for q in qs]
    assert {q for s in picked for q in templates if q.format(city=s.city) == s.question} == set(templates)
    for scenario, demonstration in zip(picked, demonstrations(picked), strict=True):
        assert demonstration.messages_and_choices[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert [t["function"]["name"] for t in demonstration.tools or []] == [t.name for t in TOOLS]
        messages = convert_to_messages(demonstration.messages_and_choices[1:])
        tool_calls = [(call["name"], call["args"]) for m in messages if m.type == "ai" for call in m.tool_calls]
        assert score(scenario, tool_calls, messages[-1].content)["reward"] == 1.0, (scenario, messages[-1].content)


def test_a_seed_repeats_the_run_token_for_token(tmp_path: Path) -> None:
    # every training rollout sends its own seed (run, step, scenario, rollout); unseeded, two such runs
    # gave step rewards 0.031, 0.081 and 0.062, 0.031
    def history(run: str, *options: str) -> list[tuple[str, int, float]]:
        out = run_example("examples.city_facts.train", "--model", "tiny-random-smollm2", "--steps", "2",
                          "--scenarios-per-step", "2", "--rollouts", "4", "--held-out", "2",
                          "--art-dir", str(tmp_path / run), *options)
        assert "training: 2 steps in" in out and ("(pipeline)" in out) == ("--pipeline" in options)
        lines = (tmp_path / run / "city-facts" / "models" / "city-agent-s0" / "history.jsonl").read_text().splitlines()
        return [(r["split"], r["step"], r["reward/mean"]) for r in map(json.loads, lines)]

    first = history("first")
    assert [(split, step) for split, step, _ in first] == [("val", 0), ("train", 1), ("train", 2), ("val", 2)]
    assert history("again") == first
    # the pipeline, held on-policy, with tools and a judge that wait: every group it trains was sampled
    # by the checkpoint it trains (a group whose rollouts all scored alike is replaced, ART's rule)
    pipelined = history("pipelined", "--pipeline", "--max-steps-off-policy", "0", "--tool-seconds", "0.3",
                        "--judge-seconds", "0.2")
    assert [(split, step) for split, step, _ in pipelined] == [(split, step) for split, step, _ in first]
    folder = tmp_path / "pipelined" / "city-facts" / "models" / "city-agent-s0" / "trajectories" / "train"
    for step in (1, 2):
        groups = [json.loads(line) for line in (folder / f"{step:04d}.jsonl").read_text().splitlines()]
        assert len(groups) == 2 and {t["initial_policy_version"] for g in groups for t in g["trajectories"]} == {step - 1}

    seeds = {rollout_seed(0, step, scenario, rollout)
             for step in range(8) for scenario in range(3) for rollout in range(4)}
    assert len(seeds) == 8 * 3 * 4  # no two rollouts of a run draw alike
    assert rollout_seed(0, 1, 2, 3) == rollout_seed(0, 1, 2, 3) != rollout_seed(1, 1, 2, 3)
    # the LlamaIndex example's LLM sends it too (LlamaIndex's OpenAI LLMs take it in additional_kwargs)
    policy = Policy("http://127.0.0.1:1/v1", "m", seed=7)
    assert policy.langchain().seed == 7
    assert policy.llamaindex(additional_kwargs={"user": "u"}, context_window=2048).additional_kwargs == {
        "user": "u", "seed": 7}


def test_the_job_says_so_after_three_steps_without_signal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import asyncio
    from dataclasses import dataclass

    from art_integrations import Trajectory, art_capture
    from examples.runner import Example, train

    @dataclass(frozen=True)
    class Question:
        id: str

    async def rollout(policy: Policy, scenario: Question) -> Trajectory:  # a reward that never varies
        async with art_capture(scenario=scenario.id) as trajectory:
            pass
        trajectory.reward = 0.5
        return trajectory

    example = Example(project="flat", model_prefix="flat", title="flat",
                      scenarios=lambda split, count, seed: [Question(f"{split}{i}") for i in range(count)],
                      rollout=rollout)
    args = argparse.Namespace(steps=4, scenarios_per_step=1, rollouts=2, learning_rate=1e-3, temperature=1.0,
                              scale_rewards=True, beta=0.0, seed=0,
                              name=None, ruler=False, model="tiny-random-smollm2", engine="torch", backend_url=None,
                              art_dir=str(tmp_path), held_out=1, max_tokens=8, sft_demos=0, sft_epochs=2,
                              sft_learning_rate=5e-4, waits={}, pipeline=False)
    asyncio.run(train(example, args))
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 4 and all("groups trained 0/1, policy entropy n/a" in line for line in steps)
    notes = [line for line in lines if line.startswith("No group has had signal")]
    assert notes == [no_signal_note(3, 3)] and lines.index(notes[0]) == lines.index(steps[2]) + 1


def test_probe_samples_an_example_group_by_group_and_repeats(tmp_path: Path) -> None:
    args = ["email_search", "--model", "tiny-random-smollm2", "--scenarios", "2", "--rollouts", "2",
            "--temperatures", "1.0", "0", "--show", "--art-dir", str(tmp_path)]
    out = run_example("examples.probe", *args)
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| temperature | rollouts | reward |") and "answer_right" in table[0]
    sampled, greedy = (line.split(" | ") for line in table[2:])
    assert sampled[:2] == ["| 1", "4"] and sampled[-1].endswith("/2 |")  # 2 groups of 2
    assert greedy[:2] == ["| 0", "2"] and greedy[-1] == "- |"  # greedy: one rollout a scenario, no groups
    assert sum(line.startswith("  ") and "search_inbox(" in line for line in out.splitlines()) == 6
    assert run_example("examples.probe", *args) == out  # every rollout is seeded

    refused = subprocess.run([sys.executable, "-m", "examples.probe", "no_such_example"], capture_output=True,
                             text=True, cwd=Path(__file__).parent.parent)
    assert refused.returncode == 2 and "no example 'no_such_example'" in refused.stderr
    refused = subprocess.run([sys.executable, "-m", "examples.probe", "email_search", "--rollouts", "0"],
                             capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert refused.returncode == 2 and "--rollouts must be 1 or more" in refused.stderr
