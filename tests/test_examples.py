"""The main job runs one tiny step end to end, resumes, and its evaluation prints a table."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_backend.engine.torch_engine import TorchEngine
from art_backend.server import create_app
from art_backend.training.service import TrainingService
from examples.city_facts.task import Scenario, score
from tests.conftest import ServerThread, run_example


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
    again = run_example("examples.city_facts.train", *args)
    assert "base model held-out score (step 0, from history)" in again
    assert "step 1/1" not in again  # resumed: nothing left to train

    table = run_example("examples.city_facts.evaluate", "--model", "tiny-random-smollm2", "--art-dir", str(tmp_path),
                        "--held-out", "2", "--models", "tiny-random-smollm2", "city-agent-s0")
    assert "held-out score" in table and "city-agent-s0" in table

    # the same job against a backend running elsewhere (`art-backend serve`, on any engine)
    with ServerThread(create_app(tiny_engine, training=TrainingService(tiny_engine, tmp_path))) as running:
        remote = run_example("examples.city_facts.evaluate", "--backend-url", running.base_url, "--held-out", "2")
    assert "tiny-random-smollm2" in remote and "city-agent-s0@" in remote


def test_city_facts_reward_credits_the_fact_in_plain_words_only() -> None:
    oslo = Scenario("t", "What time is it in Oslo?", "get_local_time", "Oslo")
    assert oslo.answer == "6:50"
    call = [("get_local_time", {"city": "Oslo"})]
    assert score(oslo, call, "It is 6:50 in Oslo.") == {"right_tool": 1.0, "right_city": 1.0, "has_number": 1.0,
                                                        "plain": 1.0, "reward": pytest.approx(1.0)}
    assert score(oslo, call, "<tool_response>\n6:50\n</tool_response>")["reward"] == pytest.approx(0.6)  # echoed
    # dropping the markup along with the fact earns nothing over the lookup itself
    assert score(oslo, call, "You can use the get_local_time function.")["reward"] == pytest.approx(0.4)
    assert score(oslo, [("get_weather", {"city": "Rome"})], "")["reward"] == 0.0
