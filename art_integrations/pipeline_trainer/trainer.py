"""Train while rollouts run: ART's `PipelineTrainer` (`art.pipeline_trainer`), three stages on one
event loop.

    rollout workers --groups--> queue --batch--> train step N+1 --> served as name@N+1
        ^ a worker starts a group only if it would train within      |
        | max_steps_off_policy steps of the checkpoint it samples    |
        +------------------------ policy version <-------------------+
    eval: eval_fn(model, step, config) every eval_every_n_steps, beside both

Each trajectory records the step that was newest when its rollout started and when it ended
(`initial_policy_version`, `final_policy_version`). A group that started more than
`max_steps_off_policy` steps before the step it would train in is dropped and counted, as is a
group without signal (equal rewards). Workers are held back so that this is rare: a group
starts only when the groups ahead of it leave it a step within the bound (ART starts one
whenever a worker is free, and drops the many that land too late); one still drops when groups
started after it finish first (a slow tool). What stays off-policy within the bound is corrected per
token by the importance ratio: each token's rollout logprob is of the checkpoint that sampled it.

After a crash, `train()` again resumes at the last committed step: the scenarios that step had
taken are skipped, the rest run (state.py). Ctrl-C stops the stages in order: no new rollout, the
step in flight finishes and commits, the pending eval is cancelled.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import statistics
import time
import traceback
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic

from art_integrations.gather import TooManyRolloutErrors
from art_integrations.pipeline_trainer.config import NO_EFFECT, NOT_OFFERED, PipelineAutotuneConfig, \
    PipelineRuntimeConfig
from art_integrations.pipeline_trainer.signals import stop_on_signals
from art_integrations.pipeline_trainer.state import PipelineState
from art_integrations.pipeline_trainer.status import PipelineStatus
from art_integrations.pipeline_trainer.types import ConfigT, EvalFn, RolloutFn, ScenarioT
from art_integrations.training import TrainConfig
from art_integrations.trajectory import PendingGroup, Trajectory, TrajectoryGroup, rewards_differ

if TYPE_CHECKING:
    from art_integrations.backend import Backend
    from art_integrations.model import TrainableModel

logger = logging.getLogger(__name__)

DROP_REASONS = ("stale", "no signal", "failed")  # why a finished group is not trained (counted per run)
_STOPPED = object()  # what the training stage gets from the queue once the run is stopped


class PipelineTrainer(Generic[ScenarioT, ConfigT]):
    """ART 0.5.23's signature. Ours besides: `train_config` (every TrainConfig setting: the
    rollouts' temperature, clipping, micro-batches; then learning_rate, loss_fn and
    normalize_advantages stay at their defaults) and `max_exceptions` (failed rollouts allowed: a
    count, or a fraction of the rollouts finished so far, as in gather_trajectory_groups)."""

    def __init__(self, model: TrainableModel, backend: Backend, rollout_fn: RolloutFn[ScenarioT, ConfigT],
                 scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT], config: ConfigT,
                 eval_fn: EvalFn[ConfigT] | None = None, *,
                 num_rollout_workers: int | None = None, min_batch_size: int | None = None,
                 max_batch_size: int | None = None, queue_maxsize: int | None = None,
                 pipeline: PipelineRuntimeConfig | None = None, autotune: PipelineAutotuneConfig | None = None,
                 learning_rate: float = 1e-5, loss_fn: str = "cispo", normalize_advantages: bool = True,
                 train_config: TrainConfig | None = None, max_steps: int | None = None,
                 max_steps_off_policy: int | None = 4, discard_queue_multiplier: int = 100,
                 max_exceptions: int | float = 0, log_interval_seconds: float = 60.0, status_ewa_alpha: float = 0.2,
                 total_scenarios: int | None = None, eval_every_n_steps: int = 20, eval_at_start: bool = True,
                 resume: bool = True, **art_arguments: Any) -> None:
        self._take_art_arguments(art_arguments)
        direct = {key: value for key, value in {"num_rollout_workers": num_rollout_workers,
                                                "min_batch_size": min_batch_size, "max_batch_size": max_batch_size,
                                                "queue_maxsize": queue_maxsize}.items() if value is not None}
        if pipeline is not None and direct:
            raise ValueError("Use either pipeline=PipelineRuntimeConfig(...) or the direct pipeline settings "
                             f"({', '.join(direct)}), not both")
        self.pipeline = pipeline or PipelineRuntimeConfig(**direct)
        self.autotune = autotune or PipelineAutotuneConfig()
        if train_config is not None and (learning_rate, loss_fn, normalize_advantages) != (1e-5, "cispo", True):
            raise ValueError("train_config= holds learning_rate, loss and scale_rewards: set them there, not also "
                             "as learning_rate=, loss_fn=, normalize_advantages=")
        self.train_config = train_config or TrainConfig(learning_rate=learning_rate, loss=loss_fn,
                                                        scale_rewards=normalize_advantages)
        for name, value, least in (("max_steps", max_steps, 0), ("max_steps_off_policy", max_steps_off_policy, 0),
                                   ("eval_every_n_steps", eval_every_n_steps, 0),
                                   ("discard_queue_multiplier", discard_queue_multiplier, 1)):
            if value is not None and (not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if log_interval_seconds <= 0:
            raise ValueError(f"log_interval_seconds must be > 0, got {log_interval_seconds}")
        if isinstance(max_exceptions, bool) or not (isinstance(max_exceptions, int) and max_exceptions >= 0 or
                                                    isinstance(max_exceptions, float) and 0 <= max_exceptions < 1):
            raise ValueError(f"max_exceptions is a count (an int >= 0) or a fraction in [0, 1), got {max_exceptions!r}")
        if backend is not model.backend:
            raise ValueError(f"Model {model.name!r} is registered with another backend: call "
                             "`await model.register(backend)` with this one first")
        self.model, self.backend, self.rollout_fn, self.config, self.eval_fn = model, backend, rollout_fn, config, eval_fn
        self.max_steps, self.max_steps_off_policy = max_steps, max_steps_off_policy
        self.max_exceptions, self.resume = max_exceptions, resume
        self.eval_every_n_steps, self.eval_at_start = eval_every_n_steps, eval_at_start
        self.log_interval_seconds = log_interval_seconds
        self.min_batch_size = self.pipeline.min_batch_size
        self.max_batch_size = self.pipeline.max_batch_size or 10 * self.min_batch_size
        self.collapse_limit = discard_queue_multiplier * self.min_batch_size
        self.status = PipelineStatus(total_scenarios, status_ewa_alpha)
        self._scenarios = scenarios

    @staticmethod
    def _take_art_arguments(arguments: dict[str, Any]) -> None:
        unknown = [name for name in arguments if name not in NOT_OFFERED and name not in NO_EFFECT]
        if unknown:
            raise TypeError(f"PipelineTrainer() got unexpected keyword arguments {', '.join(map(repr, unknown))}")
        for name, value in arguments.items():
            if name in NO_EFFECT:
                logger.warning("PipelineTrainer(%s=%r) is taken but changes nothing: %s", name, value, NO_EFFECT[name])
            elif value != NOT_OFFERED[name][0]:
                raise ValueError(f"PipelineTrainer({name}={value!r}) is not offered here: {NOT_OFFERED[name][1]}")

    # ----- the run -------------------------------------------------------------------------

    async def train(self, *, handle_signals: bool = True) -> None:
        """Run the three stages until `max_steps` steps are trained, the scenarios run out, or Ctrl-C."""
        self.first_step = self.step = await self.model.get_step()
        self.next_step = self.step  # the step being trained, once a batch is taken
        saved = PipelineState.from_history(await self.model.history(), self.step) if self.resume else None
        self.state = saved or PipelineState()
        self.queue: asyncio.Queue[tuple[int, TrajectoryGroup] | None] = asyncio.Queue(
            self.pipeline.queue_maxsize or max(1, (self.max_steps_off_policy or 1) * self.max_batch_size))
        self.evals: asyncio.Queue[int] = asyncio.Queue()
        self.policy_updated = asyncio.Condition()
        self.stopping = asyncio.Event()
        self.dropped_this_step: list[int] = []
        self.gathering: list[tuple[int, TrajectoryGroup]] = []  # the batch being gathered for the next step
        self.failures: list[str] = []
        self.zero_variance_run = 0
        self.why = "max_steps reached"
        self._scenario_stream = self._numbered(self._scenarios)
        if saved is not None:
            self.status.say(f"resuming at step {self.step}: {len(saved.ledger)} scenarios already done")
        if self.eval_fn is not None and self.eval_at_start and self.step not in self.state.evaluated:
            self.evals.put_nowait(self.step)
        self._main = asyncio.current_task()
        self._interrupted = False
        restore = stop_on_signals(self._on_signal) if handle_signals else None
        rollouts = asyncio.create_task(self._rollout_stage(), name="rollouts")
        training = asyncio.create_task(self._training_stage(), name="training")
        evals = asyncio.create_task(self._eval_stage(), name="eval")
        status = asyncio.create_task(self._status_loop(), name="status")
        try:
            await asyncio.wait([rollouts, training], return_when=asyncio.FIRST_COMPLETED)
            if rollouts.done() and not rollouts.cancelled() and rollouts.exception() is not None:
                error = rollouts.exception()
                self.request_stop(f"the rollouts failed ({type(error).__name__}: {str(error).splitlines()[0]})")
            await training
            self.stopping.set()
            rollouts.cancel()
            await asyncio.gather(rollouts, return_exceptions=True)
            if not self._interrupted:  # the evals queued for the last steps still run
                await self.evals.join()
        finally:
            self.stopping.set()
            for task in rollouts, training, evals, status:
                task.cancel()
            await asyncio.gather(rollouts, training, evals, status, return_exceptions=True)
            if restore is not None:
                restore()
            print(self.status.summary(self.first_step, self.step, self.why), flush=True)
        if not rollouts.cancelled() and rollouts.exception() is not None:
            raise rollouts.exception()  # type: ignore[misc]

    def request_stop(self, why: str = "a stop was requested") -> None:
        """Stop cleanly: no new rollout; a step in flight commits; the pending eval is cancelled."""
        if not self.stopping.is_set():
            self.why = why
            self.stopping.set()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.stopping.is_set() and self._main is not None:
            self._main.cancel()
            return
        print(f"{sig.name}: stopping after the step in flight (again to stop at once)", flush=True)
        self._interrupted = True
        self.request_stop(f"{sig.name} was received")

    # ----- rollouts ------------------------------------------------------------------------

    async def _numbered(self, scenarios: AsyncIterator[ScenarioT] | Iterable[ScenarioT]
                        ) -> AsyncIterator[tuple[int, ScenarioT]]:
        index = 0
        if isinstance(scenarios, AsyncIterator):
            async for scenario in scenarios:
                yield index, scenario
                index += 1
        else:
            for scenario in scenarios:
                yield index, scenario
                index += 1

    async def _next_scenario(self) -> tuple[int, ScenarioT] | None:
        async with self._scenario_lock:
            async for index, scenario in self._scenario_stream:
                if not self.state.ledger.is_done(index):
                    return index, scenario
            return None

    async def _rollout_stage(self) -> None:
        self._scenario_lock = asyncio.Lock()
        workers = [asyncio.create_task(self._rollout_worker()) for _ in range(self.pipeline.num_rollout_workers)]
        try:
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        await self.queue.put(None)  # the scenarios ran out

    def _would_be_stale(self) -> bool:
        """Whether a group started now would train more than max_steps_off_policy steps after the
        checkpoint it samples from: the groups ahead of it (running, queued, in the batch being
        gathered) fill the steps before its own, after the step in training, if one is."""
        if self.max_steps_off_policy is None:
            return False
        ahead = self.status.rolling_out + self.status.queued + len(self.gathering)
        steps_before_its_own = (self.next_step > self.step) + ahead // self.min_batch_size
        return steps_before_its_own > self.max_steps_off_policy

    async def _rollout_worker(self) -> None:
        while not self.stopping.is_set():
            # ART's workers start whenever the step in training is within the bound, so with more
            # workers than a batch holds their groups land steps later and are dropped as stale:
            # here a worker starts one only if it would train within the bound, counted at once
            # (rolling_out) so the next worker's check sees it
            async with self.policy_updated:
                await self.policy_updated.wait_for(lambda: self.stopping.is_set() or not self._would_be_stale())
                self.status.rolling_out += 1
            taken = None if self.stopping.is_set() else await self._next_scenario()
            if taken is None:
                self.status.rolling_out -= 1
                return
            index, scenario = taken
            version = self.step
            self.status.scenarios_started += 1
            try:
                group = self.rollout_fn(self.model, scenario, self.config)
                group = await group if inspect.isawaitable(group) else group
                if isinstance(group, PendingGroup):
                    group = await group
                if not isinstance(group, TrajectoryGroup):
                    raise TypeError(f"rollout_fn returned {type(group).__name__}, not a TrajectoryGroup: return "
                                    "`await TrajectoryGroup(rollout(...) for _ in range(n))`")
            except asyncio.CancelledError:
                raise
            except Exception as error:
                group = TrajectoryGroup(exceptions=["".join(traceback.format_exception(error))])
            finally:
                self.status.rolling_out -= 1
            for trajectory in group.trajectories:
                if trajectory.initial_policy_version is None:
                    trajectory.initial_policy_version = version
                if trajectory.final_policy_version is None:
                    trajectory.final_policy_version = self.step
            self._count_failures(group)
            self.status.queued += 1
            await self.queue.put((index, group))

    def _count_failures(self, group: TrajectoryGroup) -> None:
        self.failures.extend(group.exceptions)
        self.status.rollouts_failed += len(group.exceptions)
        self.status.rollouts_done += len(group.trajectories) + len(group.exceptions)
        budget = (self.max_exceptions if isinstance(self.max_exceptions, int)
                  else int(self.max_exceptions * self.status.rollouts_done))
        if len(self.failures) > budget:
            raise TooManyRolloutErrors(f"{len(self.failures)} of {self.status.rollouts_done} rollouts failed, over "
                                       f"max_exceptions={self.max_exceptions}. First failure:\n{self.failures[0]}")

    # ----- training ------------------------------------------------------------------------

    async def _training_stage(self) -> None:
        stop_at = None if self.max_steps is None else self.first_step + self.max_steps
        while stop_at is None or self.step < stop_at:
            waited = time.monotonic()
            batch = await self._collect_batch()
            waited = time.monotonic() - waited
            if not batch:
                return
            await self._train(batch, waited)
        self.why = "max_steps reached"

    async def _collect_batch(self) -> list[tuple[int, TrajectoryGroup]]:
        """At least min_batch_size groups with signal and within the staleness bound (fewer
        when the scenarios ran out), then up to max_batch_size of those already queued."""
        batch: list[tuple[int, TrajectoryGroup]] = []
        self.gathering = batch
        while len(batch) < self.max_batch_size:
            if len(batch) >= self.min_batch_size and self.queue.empty():
                break
            item = await self._get_or_stop()
            if item is _STOPPED:
                return []  # a batch still being gathered is no step in flight: not trained
            if item is None:  # the scenarios ran out: the groups gathered so far make the last step
                self.why = f"the scenarios ran out (after {self.status.scenarios_started} scenarios)"
                self.stopping.set()
                break
            self.status.queued -= 1
            index, group = item
            reason = self._drop_reason(group)
            if reason is None:
                self.zero_variance_run = 0
                batch.append(item)
                continue
            self.status.dropped[reason] += 1
            self.dropped_this_step.append(index)
            async with self.policy_updated:  # one group fewer ahead: a worker may start
                self.policy_updated.notify_all()
            if reason == "no signal":
                self.zero_variance_run += 1
                if self.zero_variance_run >= self.collapse_limit:
                    self.why = (f"{self.zero_variance_run} groups in a row had equal rewards (no signal): the policy "
                                "may have collapsed. Lower the learning rate, vary the scenarios or give partial "
                                "credit; discard_queue_multiplier raises this limit")
                    self.stopping.set()
                    break
        return batch

    async def _get_or_stop(self) -> Any:
        """The next finished group, None once the scenarios ran out, or _STOPPED."""
        if self.stopping.is_set():
            return _STOPPED
        getter = asyncio.ensure_future(self.queue.get())
        stopper = asyncio.ensure_future(self.stopping.wait())
        await asyncio.wait([getter, stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if getter.done():
            return getter.result()
        getter.cancel()
        return _STOPPED

    def _drop_reason(self, group: TrajectoryGroup) -> str | None:
        if not group.trajectories:
            return "failed"
        started = min(t.initial_policy_version for t in group.trajectories if t.initial_policy_version is not None)
        if self.max_steps_off_policy is not None and started < self.step - self.max_steps_off_policy:
            return "stale"
        if not rewards_differ([t.reward for t in group.trajectories]):
            return "no signal"
        return None

    async def _train(self, batch: list[tuple[int, TrajectoryGroup]], waited: float) -> None:
        # in the scenarios' order, not the order they finished in: a run repeats whatever the timing
        groups = [group for _, group in sorted(batch, key=lambda item: item[0])]
        async with self.policy_updated:
            self.next_step = self.step + 1
            self.gathering = []
            self.policy_updated.notify_all()
        for index in [*self.dropped_this_step, *(index for index, _ in batch)]:
            self.state.ledger.mark(index)  # committed with this step; a failed step raises and stops the run
        off_policy = statistics.fmean(self.step - min(t.initial_policy_version or 0 for t in g.trajectories)
                                      for g in groups)
        metrics = {"pipeline/steps_off_policy": off_policy, "pipeline/batch_wait_seconds": waited,
                   **{f"pipeline/dropped_{reason.replace(' ', '_')}": float(self.status.dropped[reason])
                      for reason in DROP_REASONS}}
        self.status.training = len(groups)
        started = time.monotonic()
        result = await self.model.train(groups, self.train_config, metrics=metrics, state=self.state.to_record())
        train_seconds = time.monotonic() - started
        self.status.training = 0
        self.dropped_this_step = []
        async with self.policy_updated:
            self.step = self.next_step = result.step
            self.policy_updated.notify_all()
        rewards = [t.reward for g in groups for t in g.trajectories]
        self.status.note_step(result.step, len(groups), statistics.fmean(rewards), waited + train_seconds,
                              train_seconds, waited, off_policy)
        if self.eval_fn is not None and self.eval_every_n_steps and result.step % self.eval_every_n_steps == 0:
            self.evals.put_nowait(result.step)

    # ----- eval ----------------------------------------------------------------------------

    async def _eval_stage(self) -> None:
        while True:
            step = await self.evals.get()
            try:
                await self._run_eval(step)
            finally:
                self.evals.task_done()

    async def _run_eval(self, step: int) -> None:
        assert self.eval_fn is not None
        started = time.monotonic()
        try:
            result = await self.eval_fn(self.model, step, self.config)
            splits = result if isinstance(result, Mapping) else {"val": result}
            reward = None
            for split, items in splits.items():
                groups = [item for item in items if isinstance(item, TrajectoryGroup)]
                loose = [item for item in items if isinstance(item, Trajectory)]
                if loose:
                    groups.append(TrajectoryGroup(loose))
                trajectories = [t for g in groups for t in g.trajectories]
                if split == "val" and trajectories:
                    reward = statistics.fmean(t.reward for t in trajectories)
                await self.model.log(groups, split=split, step=step,
                                     metrics={"pipeline/eval_seconds": time.monotonic() - started})
            self.state.evaluated.add(step)
            self.status.note_eval(step, reward, time.monotonic() - started)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # an eval that fails does not stop training: said, and kept in the logs
            logger.warning("eval of step %d failed: %r", step, error, exc_info=True)
            self.status.say(f"eval of step {step} failed: {error!r}")

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.log_interval_seconds / 10))
            if self.status.due(self.log_interval_seconds):
                self.status.say("running")
