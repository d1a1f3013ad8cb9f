"""PipelineTrainer (ART's `art.pipeline_trainer`) on a real backend (the tiny model, in this process):
rollouts that run while a step trains, the checkpoint each trajectory records, staleness, resuming
after a stop with nothing trained twice or lost, the exception budget, Ctrl-C, and ART's arguments
refused by name."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from art_integrations import TooManyRolloutErrors, TrainableModel, TrainConfig, TrajectoryGroup, art_capture
from art_integrations.pipeline_trainer import (
    PipelineAutotuneConfig,
    PipelineRuntimeConfig,
    PipelineTrainer,
    make_group_rollout_fn,
)
from tests.conftest import tiny_backend

TRAIN = TrainConfig(learning_rate=1e-3, micro_batch_tokens=256)


async def _call(model: TrainableModel, scenario: dict[str, Any], reward: float) -> Any:
    async with art_capture() as trajectory:
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), max_tokens=4, messages=[{"role": "user", "content": scenario["q"]}])
    trajectory.reward = reward
    trajectory.metadata["scenario"] = scenario["id"]
    return trajectory


async def _pair(model: TrainableModel, scenario: dict[str, Any], config: Any) -> TrajectoryGroup:
    """Two real rollouts of the scenario, rewarded 0 and 1 (a group with signal)."""
    if scenario.get("after_step"):  # a slow tool: it answers once the step has been trained
        for _ in range(1200):
            if await model.get_step() >= scenario["after_step"]:
                break
            await asyncio.sleep(0.05)
    return TrajectoryGroup([await _call(model, scenario, 0.0), await _call(model, scenario, 1.0)])


def _scenarios(n: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"id": i, "q": f"question {i}", **extra} for i in range(n)]


async def _trained_steps(trainer: PipelineTrainer[Any, Any]) -> list[dict[str, Any]]:
    """Run `trainer` to its end, then close its backend; the train records of the model's history."""
    try:
        await trainer.train(handle_signals=False)
        return [r for r in await trainer.model.history() if r["split"] == "train"]
    finally:
        await trainer.backend.close()


def _trained(art_dir: Path, name: str) -> dict[int, list[dict[str, Any]]]:
    """Each committed step's trained trajectories, as stored."""
    folder = art_dir / "pipe" / "models" / name / "trajectories" / "train"
    return {int(p.stem): [t for line in p.read_text().splitlines() for t in json.loads(line)["trajectories"]]
            for p in sorted(folder.glob("*.jsonl"))}


@pytest.mark.parametrize("max_steps_off_policy", [0, 1])
async def test_workers_start_only_groups_that_train_within_the_bound(
        tmp_path: Path, max_steps_off_policy: int, capsys: pytest.CaptureFixture[str]) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)
    running, most_running = 0, 0

    async def counted(model: TrainableModel, scenario: dict[str, Any], config: Any) -> TrajectoryGroup:
        nonlocal running, most_running
        running += 1
        most_running = max(most_running, running)
        try:
            return await _pair(model, scenario, config)
        finally:
            running -= 1

    # six workers, two groups a step: at most (bound + 1) steps' worth of groups run at once, so
    # none lands more than the bound behind and none is dropped
    trainer = PipelineTrainer(model, backend, counted, _scenarios(6), None, num_rollout_workers=6, min_batch_size=2,
                              max_batch_size=2, max_steps_off_policy=max_steps_off_policy, train_config=TRAIN)
    history = await _trained_steps(trainer)
    trained = _trained(tmp_path, "agent")
    assert sorted(trained) == [1, 2, 3] and not trainer.status.dropped
    assert most_running == 2 * (max_steps_off_policy + 1)
    assert all(t["initial_policy_version"] == 0 and t["final_policy_version"] == 0 for t in trained[1])
    off_policy = [r["pipeline/steps_off_policy"] for r in history]
    assert max(off_policy) <= max_steps_off_policy and "pipeline/batch_wait_seconds" in history[0]
    if max_steps_off_policy == 1:  # step 2's groups ran while step 1 trained: sampled by step 0
        assert off_policy[1] == 1.0 and all(t["initial_policy_version"] == 0 for t in trained[2])
    out = capsys.readouterr().out
    assert "step 1: 2 groups" in out and "stopped because the scenarios ran out (after 6 scenarios)" in out


async def test_a_group_overtaken_by_later_ones_is_dropped_as_stale(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)
    # scenario 0 starts at step 0 and waits on a slow tool until step 2 is trained; 1, 2 and 3 pass
    # it and train steps 1-3: when it lands it is two steps behind, over the bound of one
    scenarios = [{"id": 0, "q": "question 0", "after_step": 2}, *_scenarios(4)[1:]]
    trainer = PipelineTrainer(model, backend, _pair, scenarios, None, num_rollout_workers=3, min_batch_size=1,
                              max_batch_size=1, max_steps_off_policy=1, train_config=TRAIN)
    history = await _trained_steps(trainer)
    trained = _trained(tmp_path, "agent")
    assert {step: {t["metadata"]["scenario"] for t in ts} for step, ts in trained.items()} == {1: {1}, 2: {2}, 3: {3}}
    assert trainer.status.dropped == {"stale": 1} and [r["pipeline/steps_off_policy"] for r in history] == [0, 0, 0]
    out = capsys.readouterr().out
    assert "1 dropped (1 stale)" in out and "stopped because the scenarios ran out (after 4 scenarios)" in out


async def test_a_stopped_run_resumes_at_its_last_step_with_every_scenario_trained_once(tmp_path: Path) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)
    scenarios = _scenarios(8)
    evaluated: list[int] = []

    async def eval_fn(model: TrainableModel, step: int, config: Any) -> list[Any]:
        evaluated.append(step)
        return [await _call(model, {"id": -1, "q": "held out"}, 0.5)]

    def trainer(max_steps: int | None) -> PipelineTrainer[Any, Any]:
        return PipelineTrainer(model, backend, _pair, scenarios, None, eval_fn, num_rollout_workers=4,
                               min_batch_size=2, max_batch_size=2, max_steps=max_steps, eval_every_n_steps=2,
                               train_config=TRAIN)

    try:
        await trainer(max_steps=1).train(handle_signals=False)  # stops with rollouts in flight, as a crash would
        assert await model.get_step() == 1
        await trainer(max_steps=None).train(handle_signals=False)
        step = await model.get_step()
        val = [r for r in await model.history() if r["split"] == "val"]
    finally:
        await backend.close()
    trained = _trained(tmp_path, "agent")
    ids = [t["metadata"]["scenario"] for trajectories in trained.values() for t in trajectories]
    assert step == 4 and sorted(ids) == sorted([i for i in range(8) for _ in range(2)])  # each once, none lost
    # at each run's start (step 0, then step 1, which nothing evaluated), then every second step
    assert evaluated == [0, 1, 2, 4]
    assert [r["step"] for r in val] == [0, 1, 2, 4] and all("pipeline/eval_seconds" in r for r in val)


async def test_failed_rollouts_count_against_the_budget_and_committed_steps_stand(tmp_path: Path) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)

    async def rollout(model: TrainableModel, scenario: dict[str, Any], config: Any) -> Any:
        if scenario["id"] >= 2:
            while await model.get_step() < 1:  # after step 1, every rollout fails
                await asyncio.sleep(0.05)
            raise ConnectionError("the tool's server is down")
        return await _call(model, scenario, 0.0)

    async def varied(model: TrainableModel, scenario: dict[str, Any], config: Any) -> TrajectoryGroup:
        group = await make_group_rollout_fn(rollout, n=2)(model, scenario, config)
        for i, trajectory in enumerate(group.trajectories):
            trajectory.reward = float(i)
        return group

    trainer = PipelineTrainer(model, backend, varied, _scenarios(6), None, num_rollout_workers=6, min_batch_size=2,
                              max_batch_size=2, max_exceptions=3, train_config=TRAIN)
    try:
        with pytest.raises(TooManyRolloutErrors, match=r"(?s)4 of \d+ rollouts failed, over max_exceptions=3.*tool's server"):
            await trainer.train(handle_signals=False)
        assert await model.get_step() == 1
    finally:
        await backend.close()


async def test_ctrl_c_stops_after_the_step_in_flight_and_the_callers_handler_is_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)

    def mine(signum: int, frame: Any) -> None:
        raise AssertionError("the caller's handler ran")

    async def rollout(model: TrainableModel, scenario: dict[str, Any], config: Any) -> TrajectoryGroup:
        if scenario["id"] == 5:
            while await model.get_step() < 1:
                await asyncio.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
        return await _pair(model, scenario, config)

    previous = signal.signal(signal.SIGINT, mine)
    try:
        trainer = PipelineTrainer(model, backend, rollout, _scenarios(40), None, num_rollout_workers=2,
                                  min_batch_size=2, max_batch_size=2, train_config=TRAIN)
        await trainer.train()
        step = await model.get_step()
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
        await backend.close()
    out = capsys.readouterr().out
    assert "SIGINT: stopping after the step in flight" in out and "stopped because SIGINT was received" in out
    assert 1 <= step < 10 and len(_trained(tmp_path, "agent")) == step


async def test_arts_arguments_not_offered_are_refused_by_name(tmp_path: Path) -> None:
    backend = tiny_backend(tmp_path)
    model = TrainableModel(name="agent", project="pipe")
    await model.register(backend)
    try:
        def make(**kwargs: Any) -> Any:
            return PipelineTrainer(model, backend, _pair, [], None, **kwargs)

        with pytest.raises(ValueError, match=r"kl_penalty_coef=0.1\) is not offered here: .*TrainConfig\(beta"):
            make(kl_penalty_coef=0.1)
        with pytest.raises(ValueError, match="rollout_executor=.*RayRollouts"):
            make(rollout_executor=object())
        with pytest.raises(TypeError, match="'num_workers'"):
            make(num_workers=4)
        with pytest.raises(ValueError, match="not both"):
            make(pipeline=PipelineRuntimeConfig(min_batch_size=2), min_batch_size=2)
        with pytest.raises(ValueError, match="mode"):
            PipelineAutotuneConfig(mode="online")
        with pytest.raises(ValueError, match="train_config= holds learning_rate"):
            make(train_config=TRAIN, learning_rate=1e-4)
        with pytest.raises(ValueError, match="max_exceptions"):
            make(max_exceptions=1.5)
        make(kl_penalty_coef=0.0, save_checkpoint=True, pipeline=PipelineRuntimeConfig(min_batch_size=1))  # as here
        # the backend's side: a client's metric may not take a name the step records, nor log a step not trained
        group = await _pair(model, {"id": 0, "q": "x"}, None)
        with pytest.raises(Exception, match="'reward/mean'.*name the client's metrics differently"):
            await model.train([group], TRAIN, metrics={"reward/mean": 1.0})
        assert await model.get_step() == 0
        with pytest.raises(Exception, match="step 5 is not trained yet"):
            await model.log([group], split="val", step=5)
    finally:
        await backend.close()
