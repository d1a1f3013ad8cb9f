"""Running rollouts in groups: N rollouts per scenario, many scenarios at once.

    groups = await gather_trajectory_groups(
        [trajectory_group(lambda: rollout(scenario), n=8, scenario=scenario.id) for scenario in scenarios],
        max_concurrency=32, max_exceptions=0.1, after_each=score_group)

A failed rollout (one that raised, or returned something else than a Trajectory) is kept:
its traceback goes into its group's `exceptions`. Past the budget (`max_exceptions`: a count,
or a fraction of all rollouts) the remaining rollouts are cancelled and `TooManyRolloutErrors`
says which failed and why. ART's style works too: `TrajectoryGroup(rollout(s) for _ in range(8))`
(awaitables, not started) in place of `trajectory_group(...)`, and `pbar_desc=` for `desc=`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import traceback
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from tqdm.auto import tqdm

from art_integrations.capture.scope import CaptureScope
from art_integrations.capture.tokens import deferred_token_fetch, fetch_tokens
from art_integrations.trajectory import NotATrajectoryError, PendingGroup, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_integrations.observability.langfuse import StepExport

logger = logging.getLogger(__name__)

AfterEach = Callable[[TrajectoryGroup], Any]  # -> TrajectoryGroup, a list of them, or None; or an awaitable of one


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


class RolloutRunner(Protocol):
    """Where rollouts run when not in this process (`RayRollouts`: a Ray cluster)."""

    def remote(self, rollout: Callable[[], Awaitable[Trajectory]]) -> Callable[[], Awaitable[Trajectory]]:
        """`rollout` sent away once (per group); each call of the result runs it there once and
        returns the finished trajectory, its tokens fetched."""
        ...


def trajectory_group(rollout: Callable[[], Awaitable[Trajectory]] | Iterable[Any], n: int | None = None,
                     **metadata: Any) -> Any:
    """Describe a group: `rollout()` is called `n` times (each call one independent rollout).

    Given rollouts instead (ART 0.5.23's `await art.trajectory_group(rollouts, metadata=...,
    return_exceptions=...)`: trajectories, exceptions, or awaitables of trajectories, such as
    `art.trajectory(rollout(s))`), it is an awaitable of the finished TrajectoryGroup."""
    if not callable(rollout):
        if n is not None:
            raise TypeError("trajectory_group(rollouts) takes the rollouts themselves, not n: give n only with a "
                            "rollout function, trajectory_group(rollout, n=8)")
        return _awaited_group(rollout, **metadata)
    if n is None or n < 1:
        raise ValueError(f"a group needs at least one rollout, got n={n}")
    return RolloutGroup(rollout, n, metadata)


async def _awaited_group(trajectories: Iterable[Any], *, exceptions: Iterable[BaseException | str] = (),
                         metadata: dict[str, Any] | None = None, metrics: dict[str, float | int | bool] | None = None,
                         logs: list[str] | None = None, return_exceptions: bool = False) -> TrajectoryGroup:
    """ART's `trajectory_group`: the awaitables run together; a failed one is raised, or with
    `return_exceptions=True` kept in the group's `exceptions`."""
    items = list(trajectories)
    results = iter(await asyncio.gather(*(item for item in items if inspect.isawaitable(item)),
                                        return_exceptions=return_exceptions))
    done = [next(results) if inspect.isawaitable(item) else item for item in items]
    done = [item if isinstance(item, (Trajectory, BaseException)) else NotATrajectoryError.of(item) for item in done]
    return TrajectoryGroup(done, exceptions=list(exceptions), metadata=metadata or {}, metrics=metrics or {},
                           logs=logs or [])


class StartedRollouts:
    """The rollout of a group made of awaitables (ART's `TrajectoryGroup(coroutines)`): each call
    hands out the next one. They exist already, so they run in this process only."""

    def __init__(self, rollouts: list[Awaitable[Trajectory]]) -> None:
        self.waiting = list(reversed(rollouts))

    def __call__(self) -> Awaitable[Trajectory]:
        return self.waiting.pop()

    def close(self) -> None:
        """Close the ones never run (a cancelled gather), which Python would warn about."""
        for rollout in self.waiting:
            if inspect.iscoroutine(rollout):
                rollout.close()
        self.waiting.clear()


def _groups_of(outcome: Any) -> list[TrajectoryGroup]:
    """What `after_each` returned, as the groups to keep."""
    groups = [] if outcome is None else outcome if isinstance(outcome, list) else [outcome]
    for group in groups:
        if not isinstance(group, TrajectoryGroup):
            raise TypeError(f"after_each returned {type(group).__name__}: return the group, a list of groups, "
                            "or None to drop it")
    return groups


def _rollout_group(item: RolloutGroup | PendingGroup) -> RolloutGroup:
    if isinstance(item, RolloutGroup):
        return item
    if isinstance(item, PendingGroup):
        if set(item.fields) - {"metadata"}:
            raise TypeError(f"a pending TrajectoryGroup takes only metadata= beside its rollouts, not "
                            f"{', '.join(sorted(set(item.fields) - {'metadata'}))}")
        return RolloutGroup(StartedRollouts(item.rollouts), len(item.rollouts), dict(item.fields.get("metadata", {})))
    raise TypeError(f"gather_trajectory_groups takes groups of rollouts not run yet: trajectory_group(rollout, n) or "
                    f"TrajectoryGroup(rollout(...) for _ in range(n)), not {type(item).__name__}")


def completion_tokens(trajectory: Trajectory) -> int:
    return sum(len(c.token_ids or []) for h in trajectory.histories() for c in h.choices())


async def gather_trajectories(rollout: Callable[[], Awaitable[Trajectory]] | Iterable[Awaitable[Trajectory]],
                              n: int | None = None, *, pbar_desc: str | None = None, max_exceptions: int | float = 0,
                              runner: RolloutRunner | None = None, **metadata: Any) -> Any:
    """Run one group of `n` rollouts of the same scenario: `gather_trajectories(rollout, n)` gives
    the TrajectoryGroup. ART's form, awaitables not started (`gather_trajectories(rollout(s) for s
    in scenarios, pbar_desc="val")`), gives the list of trajectories, failures left out (counted
    against `max_exceptions`, their tracebacks logged). `runner`: as for gather_trajectory_groups."""
    if callable(rollout):
        if n is None:
            raise TypeError("gather_trajectories(rollout, n): say how many rollouts to run")
        spec = trajectory_group(rollout, n, **metadata)
        return (await gather_trajectory_groups([spec], progress=pbar_desc is not None, desc=pbar_desc or "gather",
                                               max_exceptions=max_exceptions, runner=runner))[0]
    if n is not None or metadata:
        raise TypeError("gather_trajectories(awaitables) takes no n or metadata: each awaitable is one rollout")
    group = (await gather_trajectory_groups([PendingGroup(list(rollout), {})], desc=pbar_desc or "gather",
                                            max_exceptions=max_exceptions, runner=runner))[0]
    for failure in group.exceptions:
        logger.warning("a rollout failed and is left out:\n%s", failure)
    return group.trajectories


async def gather_trajectory_groups(
    groups: Iterable[RolloutGroup | PendingGroup],
    *,
    max_concurrency: int | None = None,
    max_exceptions: int | float = 0,
    after_each: AfterEach | None = None,
    progress: bool = True,
    desc: str = "gather",
    pbar_desc: str | None = None,
    langfuse: StepExport | None = None,
    runner: RolloutRunner | None = None,
) -> GatheredGroups:
    """Run every rollout of every group (at most `max_concurrency` at once) and return the
    groups in order. `after_each(group)` runs as each group completes (e.g. RULER scoring); it
    may change the group, return a replacement, or return None to drop it (logged).
    `langfuse=exporter.for_step(model, step)` sends each kept group, scored, to Langfuse.
    `pbar_desc`: ART's name for `desc`. `runner=RayRollouts(...)` runs each rollout on a Ray
    cluster (captures and token fetches happen there); by default they run in this process."""
    if pbar_desc is not None:
        if desc != "gather" and desc != pbar_desc:
            raise TypeError(f"desc={desc!r} and pbar_desc={pbar_desc!r} name the same thing: pass one")
        desc = pbar_desc
    specs = [_rollout_group(item) for item in groups]
    total = sum(spec.n for spec in specs)
    budget = max_exceptions if isinstance(max_exceptions, int) else int(max_exceptions * total)
    limit = asyncio.Semaphore(max_concurrency or total or 1)
    gathered = [TrajectoryGroup(metadata=dict(spec.metadata)) for spec in specs]
    # after_each may replace a group, split it (a list, as ART allows) or drop it (None)
    results: list[list[TrajectoryGroup]] = [[group] for group in gathered]
    dropped: list[dict[str, Any]] = []
    failures: list[str] = []
    bar = tqdm(total=total, desc=desc, disable=not progress, unit="rollout")
    rewards: list[float] = []
    tokens = 0
    pending: list[list[CaptureScope]] = [[] for _ in specs]  # captures whose tokens are fetched per group

    def show_progress() -> None:
        if rewards:
            bar.set_postfix(reward=f"{statistics.fmean(rewards):.3f}", tokens=tokens, errors=len(failures))

    async def run(index: int, spec: RolloutGroup) -> Trajectory | None:
        async with limit:
            try:
                with deferred_token_fetch(pending[index]):
                    trajectory = await spec.rollout()
                if not isinstance(trajectory, Trajectory):
                    raise NotATrajectoryError.of(trajectory)
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
                rewards.append(trajectory.reward)
                return trajectory
            finally:
                bar.update(1)
                show_progress()
            return None

    async def run_group(index: int, spec: RolloutGroup) -> None:
        nonlocal tokens
        if runner is not None:  # a rollout function that cannot be sent fails the gather, not n rollouts
            spec = replace(spec, rollout=runner.remote(spec.rollout))
        finished = await asyncio.gather(*(run(index, spec) for _ in range(spec.n)))
        # in the order the rollouts started, not finished: a seeded run then trains on the same
        # sequences in the same order, whatever the timing
        gathered[index].trajectories.extend(t for t in finished if t is not None)
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
            results[index] = _groups_of(outcome)
        if langfuse is not None:
            for kept in results[index]:
                langfuse.export_group(kept, index)

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
        for spec in specs:
            if isinstance(spec.rollout, StartedRollouts):
                spec.rollout.close()
    kept = GatheredGroups(group for groups_of_one in results for group in groups_of_one)
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
