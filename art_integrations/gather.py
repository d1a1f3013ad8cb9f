"""Running rollouts in groups: N rollouts per scenario, many scenarios at once.

    groups = await gather_trajectory_groups(
        [trajectory_group(lambda: rollout(scenario), n=8, scenario=scenario.id) for scenario in scenarios],
        max_concurrency=32, max_exceptions=0.1, after_each=score_group)

A failed rollout is kept: its traceback goes into its group's `exceptions`. Past the budget
(`max_exceptions`: a count, or a fraction of all rollouts) the remaining rollouts are
cancelled and `TooManyRolloutErrors` says which failed and why.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import traceback
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from art_integrations.capture import CaptureScope, deferred_token_fetch, fetch_tokens
from art_integrations.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_integrations.observability.langfuse import StepExport

logger = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], "Awaitable[TrajectoryGroup | None] | TrajectoryGroup | None"]


class TooManyRolloutErrors(RuntimeError):
    pass


class GatheredGroups(list[TrajectoryGroup]):
    """The groups kept, plus why any were dropped by `after_each` (e.g. a judge that failed):
    `model.train(groups)` reports those in the step's metrics and history, so none vanishes."""

    dropped: list[dict[str, Any]]


@dataclass
class RolloutGroup:
    """`n` rollouts of one scenario, not started yet."""

    rollout: Callable[[], Awaitable[Trajectory]]
    n: int
    metadata: dict[str, Any] = field(default_factory=dict)


def trajectory_group(rollout: Callable[[], Awaitable[Trajectory]], n: int, **metadata: Any) -> RolloutGroup:
    """Describe a group: `rollout()` is called `n` times (each call one independent rollout)."""
    if n < 1:
        raise ValueError(f"a group needs at least one rollout, got n={n}")
    return RolloutGroup(rollout, n, metadata)


def completion_tokens(trajectory: Trajectory) -> int:
    return sum(len(c.token_ids or []) for h in trajectory.histories() for c in h.choices())


async def gather_trajectories(rollout: Callable[[], Awaitable[Trajectory]], n: int,
                              **metadata: Any) -> TrajectoryGroup:
    """Run one group of `n` rollouts of the same scenario."""
    return (await gather_trajectory_groups([trajectory_group(rollout, n, **metadata)], progress=False))[0]


async def gather_trajectory_groups(
    groups: Iterable[RolloutGroup],
    *,
    max_concurrency: int | None = None,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    progress: bool = True,
    desc: str = "gather",
    langfuse: StepExport | None = None,
) -> GatheredGroups:
    """Run every rollout of every group (at most `max_concurrency` at once) and return the
    groups in order. `after_each(group)` runs as each group completes (e.g. RULER scoring); it
    may change the group, return a replacement, or return None to drop it (logged).
    `langfuse=exporter.for_step(model, step)` sends each kept group, scored, to Langfuse."""
    specs = list(groups)
    total = sum(spec.n for spec in specs)
    budget = max_exceptions if isinstance(max_exceptions, int) else int(max_exceptions * total)
    limit = asyncio.Semaphore(max_concurrency or total or 1)
    gathered = [TrajectoryGroup(metadata=dict(spec.metadata)) for spec in specs]
    results: list[TrajectoryGroup | None] = list(gathered)  # after_each may replace or drop (None) a group
    dropped: list[dict[str, Any]] = []
    failures: list[str] = []
    bar = tqdm(total=total, desc=desc, disable=not progress, unit="rollout")
    rewards: list[float] = []
    tokens = 0
    pending: list[list[CaptureScope]] = [[] for _ in specs]  # captures whose tokens are fetched per group

    def show_progress() -> None:
        if rewards:
            bar.set_postfix(reward=f"{statistics.fmean(rewards):.3f}", tokens=tokens, errors=len(failures))

    async def run(index: int, spec: RolloutGroup) -> None:
        async with limit:
            try:
                with deferred_token_fetch(pending[index]):
                    trajectory = await spec.rollout()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                trace = "".join(traceback.format_exception(error))
                gathered[index].exceptions.append(trace)
                failures.append(trace)
                if len(failures) > budget:
                    raise TooManyRolloutErrors(
                        f"{len(failures)} of {total} rollouts failed, over max_exceptions={max_exceptions}. "
                        f"First failure:\n{failures[0]}") from error
            else:
                if not isinstance(trajectory, Trajectory):
                    raise TypeError(f"a rollout returned {type(trajectory).__name__}, not a Trajectory")
                gathered[index].trajectories.append(trajectory)
                rewards.append(trajectory.reward)
            finally:
                bar.update(1)
                show_progress()

    async def run_group(index: int, spec: RolloutGroup) -> None:
        nonlocal tokens
        await asyncio.gather(*(run(index, spec) for _ in range(spec.n)))
        if pending[index]:
            await asyncio.to_thread(fetch_tokens, pending[index])
        group = gathered[index]
        tokens += sum(completion_tokens(t) for t in group.trajectories)
        show_progress()
        if after_each is not None:
            outcome = after_each(group)
            if inspect.isawaitable(outcome):
                outcome = await outcome
            if outcome is None:
                reason = str(group.metadata.get("ruler_error") or "after_each returned None")
                logger.warning("after_each dropped group %d (%s): %s", index, group.metadata, reason)
                dropped.append({"group": index, "metadata": group.metadata, "reason": reason,
                                "trajectories": len(group.trajectories)})
            results[index] = outcome
        if langfuse is not None and results[index] is not None:
            langfuse.export_group(results[index], index)

    tasks = [asyncio.ensure_future(run_group(i, spec)) for i, spec in enumerate(specs)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        bar.close()
    kept = GatheredGroups(group for group in results if group is not None)
    kept.dropped = dropped
    langfuse_report = await asyncio.to_thread(langfuse.flush) if langfuse is not None else None
    if progress:
        mean = f"{statistics.fmean(rewards):.3f}" if rewards else "n/a"
        # each one warned when it happened; counted here so a run that trains on empty or partial
        # trajectories says so at the end
        capture_errors = sum(int(t.metrics.get("capture_errors", 0)) for g in gathered for t in g.trajectories)
        print(f"{desc}: {len(kept)} groups ({len(dropped)} dropped), {len(rewards)} trajectories, "
              f"{len(failures)} failed rollouts, {capture_errors} capture errors (see each trajectory's logs), "
              f"reward mean {mean}, {tokens} completion tokens"
              + (f"; langfuse: {langfuse_report}" if langfuse_report is not None else ""))
    return kept
