"""Custom rewards, and a programmatic reward mixed with RULER.

The patterns, simplest first:

1. A programmatic reward, set inside the rollout: `trajectory.reward = float(answer == expected)`.
   Use it whenever the task can be checked; it is exact and free.
2. RULER alone, when it cannot: `gather_trajectory_groups(..., after_each=ruler(judge))`.
3. Both: `after_each=combine(exact_match, weight=0.5, judge=judge)` gives
   `reward = weight * programmatic + (1 - weight) * ruler`, so a checkable signal (a correct
   answer, valid output) anchors the judge's softer ranking; both parts stay as metrics
   (`programmatic_reward`, `ruler_score`) so you can see which one moved.
4. Shaping on top of any of these: adjust `trajectory.reward` in your own `after_each`
   (e.g. `- 0.1 * trajectory.metrics["tool_errors"]`); keep the parts in `metrics`.

GRPO only sees differences within a group: a reward that is equal for every trajectory of a
group teaches nothing, whatever its value.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable

from art_integrations.rewards.ruler import DEFAULT_RUBRIC, JudgeLike, ruler_score_group
from art_integrations.trajectory import Trajectory, TrajectoryGroup

Programmatic = Callable[[Trajectory], "float | Awaitable[float]"]


async def _programmatic(function: Programmatic, trajectory: Trajectory) -> float:
    value = function(trajectory)
    if inspect.isawaitable(value):
        value = await value
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"the programmatic reward returned {value!r}; it must be a finite number")
    return value


async def combine_with_ruler(group: TrajectoryGroup, programmatic: Programmatic, weight: float = 0.5,
                             judge: JudgeLike = None, rubric: str = DEFAULT_RUBRIC, *,
                             swallow_exceptions: bool = False) -> TrajectoryGroup | None:
    """`reward = weight * programmatic(t) + (1 - weight) * ruler_score`. `programmatic` (sync
    or async) sees each trajectory before RULER replaces its reward. None if RULER failed and
    `swallow_exceptions` dropped the group."""
    if not 0 <= weight <= 1:
        raise ValueError(f"weight must be within [0, 1], got {weight}")
    parts = {id(t): await _programmatic(programmatic, t) for t in group.trajectories}
    scored = await ruler_score_group(group, judge, rubric, swallow_exceptions=swallow_exceptions)
    if scored is None:
        return None
    for trajectory in scored.trajectories:
        ruler_score = trajectory.reward
        trajectory.metrics["programmatic_reward"] = parts[id(trajectory)]
        trajectory.reward = weight * parts[id(trajectory)] + (1 - weight) * ruler_score
    return scored


def combine(programmatic: Programmatic, weight: float = 0.5, judge: JudgeLike = None, rubric: str = DEFAULT_RUBRIC,
            *, swallow_exceptions: bool = False) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup | None]]:
    """`combine_with_ruler` with its settings fixed, for `gather_trajectory_groups(after_each=...)`."""

    async def score(group: TrajectoryGroup) -> TrajectoryGroup | None:
        return await combine_with_ruler(group, programmatic, weight, judge, rubric,
                                        swallow_exceptions=swallow_exceptions)

    return score
