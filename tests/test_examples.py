"""The main job runs one tiny step end to end, resumes, and its evaluation prints a table."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import run_example


def test_city_facts_main_job_runs_a_step_and_resumes(tmp_path: Path) -> None:
    args = ["--model", "tiny-random-smollm2", "--steps", "1", "--scenarios-per-step", "1", "--rollouts", "4",
            "--held-out", "2", "--art-dir", str(tmp_path)]
    out = run_example("examples.city_facts.train", *args)
    assert "base model held-out score (step 0)" in out
    assert "held-out score: base" in out
    model_dir = tmp_path / "city-facts" / "models" / "city-agent-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000
    assert (model_dir / "history.jsonl").is_file()
    trained = (model_dir / "checkpoints" / "0001").is_dir()  # rollouts that all score the same train nothing
    again = run_example("examples.city_facts.train", *args)
    assert "base model held-out score (step 0, from history)" in again
    if trained:  # resumed: nothing left to train
        assert "step 1/1" not in again

    table = run_example("examples.city_facts.evaluate", "--model", "tiny-random-smollm2", "--art-dir", str(tmp_path),
                        "--held-out", "2", "--models", "tiny-random-smollm2", "city-agent-s0")
    assert "held-out score" in table and "city-agent-s0" in table
