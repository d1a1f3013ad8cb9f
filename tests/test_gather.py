"""Groups of rollouts: concurrency limit, exception budget, after_each, order."""

from __future__ import annotations

import asyncio

import pytest

from art_integrations import (
    TooManyRolloutErrors,
    Trajectory,
    TrajectoryGroup,
    gather_trajectories,
    gather_trajectory_groups,
    trajectory_group,
)


async def test_groups_come_back_in_order_within_the_concurrency_limit() -> None:
    running = peak = 0

    async def rollout(scenario: int) -> Trajectory:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return Trajectory(reward=float(scenario))

    groups = await gather_trajectory_groups(
        [trajectory_group(lambda s=s: rollout(s), n=4, scenario=s) for s in range(5)], max_concurrency=3)
    assert peak == 3
    assert [g.metadata["scenario"] for g in groups] == list(range(5))
    assert [[t.reward for t in g.trajectories] for g in groups] == [[float(s)] * 4 for s in range(5)]



@pytest.mark.parametrize("max_concurrency", [None, 2])
async def test_a_groups_trajectories_keep_the_order_their_rollouts_started_in(max_concurrency: int | None) -> None:
    # a seeded run trains on the same sequences in the same order only if a rollout that
    # finishes first is not moved ahead of the ones started before it
    started = 0

    async def rollout() -> Trajectory:
        nonlocal started
        order = started
        started += 1
        await asyncio.sleep(0.01 * (3 - order % 4))  # in each group the last started finishes first
        return Trajectory(reward=float(order))

    groups = await gather_trajectory_groups([trajectory_group(rollout, n=4) for _ in range(2)],
                                            max_concurrency=max_concurrency, progress=False)
    rewards = [t.reward for g in groups for t in g.trajectories]
    assert sorted(rewards) == [float(i) for i in range(8)]
    for group in groups:  # each group's rollouts in the order they started
        assert [t.reward for t in group.trajectories] == sorted(t.reward for t in group.trajectories)


async def test_failed_rollouts_are_kept_with_tracebacks_within_the_budget() -> None:
    calls = 0

    async def flaky() -> Trajectory:
        nonlocal calls
        calls += 1
        if calls % 4 == 0:
            raise ValueError(f"tool exploded on call {calls}")
        return Trajectory(reward=1.0)

    groups = await gather_trajectory_groups([trajectory_group(flaky, n=4) for _ in range(2)], max_exceptions=0.25,
                                            max_concurrency=1, progress=False)
    assert [len(g.trajectories) for g in groups] == [3, 3]
    assert all(len(g.exceptions) == 1 and "ValueError: tool exploded" in g.exceptions[0] for g in groups)


async def test_over_the_budget_the_gather_stops_and_says_why() -> None:
    async def broken() -> Trajectory:
        raise RuntimeError("backend unreachable")

    with pytest.raises(TooManyRolloutErrors, match="(?s)2 of 4 rollouts failed.*backend unreachable"):
        await gather_trajectory_groups([trajectory_group(broken, n=4)], max_exceptions=1, max_concurrency=1,
                                       progress=False)


async def test_after_each_scores_or_drops_groups(capsys: pytest.CaptureFixture[str]) -> None:
    async def rollout() -> Trajectory:
        return Trajectory(reward=0.0)

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        if group.metadata["scenario"] == "drop":
            return None
        for i, trajectory in enumerate(group.trajectories):
            trajectory.reward = float(i)
        return group

    groups = await gather_trajectory_groups(
        [trajectory_group(rollout, n=2, scenario=s) for s in ("keep", "drop")], after_each=score)
    assert len(groups) == 1 and [t.reward for t in groups[0].trajectories] == [0.0, 1.0]
    assert groups.dropped == [{"group": 1, "metadata": {"scenario": "drop"}, "reason": "after_each returned None",
                               "trajectories": 2}]
    assert "gather: 1 groups (1 dropped), 4 trajectories, 0 failed rollouts" in capsys.readouterr().out


async def test_gather_trajectories_runs_one_group() -> None:
    async def rollout() -> Trajectory:
        return Trajectory(reward=0.5)

    group = await gather_trajectories(rollout, n=3, scenario="x")
    assert len(group.trajectories) == 3 and group.metadata == {"scenario": "x"}
