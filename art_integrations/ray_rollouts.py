"""`RayRollouts`: run each rollout as a task on a Ray cluster instead of in this process.

    groups = await gather_trajectory_groups(specs, runner=RayRollouts(address="auto", num_cpus=1))

The rollout function travels to a worker (pickled by Ray's cloudpickle: closures and functions
defined in a script's `__main__` go by value), runs there on that worker's event loop, and its
`art_capture()` records the calls and fetches their exact tokens in the worker before the
trajectory travels back. A `TrainableModel` or backend the function refers to travels as a client
of the same server (its URL and key), so the backend must be reachable from every node.

Everything else is `gather_trajectory_groups`' own, whichever executor runs the rollouts: a rollout
that raises counts against `max_exceptions`; a worker that dies (SIGKILL, out of memory, its node
removed) is retried by Ray up to `max_retries` times and then counts as a failed rollout; the
progress bar moves as each remote rollout finishes; a cancelled gather (Ctrl-C) cancels its
remote rollouts with `ray.cancel`.

Needs the `ray` extra: `pip install "art-integrations[ray]"`. Importing this module does not
import Ray; the first gather that uses a runner connects to the cluster.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from art_integrations.trajectory import Trajectory

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.remote_function import RemoteFunction

logger = logging.getLogger(__name__)

Rollout = Callable[[], Awaitable[Trajectory]]


class RolloutWorkerLost(RuntimeError):
    """The Ray worker running a rollout died (killed, out of memory, its node removed) more times
    than `max_retries` allowed; `gather_trajectory_groups` counts it as a failed rollout."""


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError(f"RayRollouts needs Ray ({error}): pip install \"art-integrations[ray]\"") from error
    return ray


async def _awaited(rollout: Rollout) -> Trajectory:
    return await rollout()


# One event loop per worker process, kept from rollout to rollout as one process's gather keeps
# one: clients that libraries cache per process (langchain-openai's httpx pool) are bound to the
# loop they first ran on, and on a new loop per rollout every call after the first found its pooled
# connection dead and paid the OpenAI client's retry back-off (0.5 s a call, measured).
_loop: asyncio.AbstractEventLoop | None = None


def _run_in_worker(rollout: Rollout) -> Trajectory:
    """The Ray task: one rollout on this worker's event loop. No gather runs here to defer token
    fetches, so each capture fetches its tokens on exit and the trajectory leaves complete."""
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
    task = _loop.create_task(_awaited(rollout))
    interrupted: list[bool] = []

    def cancel() -> None:
        interrupted.append(True)
        task.cancel()

    # `ray.cancel` interrupts a task with a simulated SIGINT, which Python delivers only between
    # bytecodes: a loop idling in its selector (a rollout waiting on the model) would never see it.
    # As a loop signal handler the same interrupt writes to the loop's wakeup pipe and cancels the
    # rollout, whose own cleanup (finally, async with) then runs.
    previous = signal.getsignal(signal.SIGINT)
    _loop.add_signal_handler(signal.SIGINT, cancel)
    try:
        return _loop.run_until_complete(task)
    except asyncio.CancelledError:
        if interrupted:  # end the task as Ray ends a cancelled one
            raise KeyboardInterrupt from None
        raise
    finally:
        _loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, previous)


class RayRollouts:
    """Runs `gather_trajectory_groups`' rollouts as Ray tasks, one task per rollout.

    `address`: as `ray.init(address=...)`: None connects to the cluster in `RAY_ADDRESS` or the one
    last started on this machine, else starts a local one; "auto" requires a running cluster; or
    "host:port". Ignored when this process already called `ray.init()`.
    `num_cpus`, `num_gpus`, `memory` (bytes), `resources`: what each rollout reserves, as for any
    Ray task; an agent that mostly waits on the model can take `num_cpus=0.25` (four per core).
    `max_retries`: how often Ray reruns a rollout whose worker died (-1: without limit); a rollout
    that raises is never retried: it counts against `max_exceptions`, as in-process.
    `runtime_env`: the workers' environment (`pip`, `env_vars`, `working_dir`, `py_modules`, ...).
    `options`: any other `.options()` setting of a Ray task (`scheduling_strategy`, ...).
    `autoscaling`: rollouts that no live node has the resources for are refused, since they would
    wait forever; on an autoscaling cluster, True lets them wait for the node it will start.
    """

    def __init__(self, address: str | None = None, *, num_cpus: float = 1, num_gpus: float = 0,
                 memory: int | None = None, resources: Mapping[str, float] | None = None, max_retries: int = 3,
                 runtime_env: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None,
                 autoscaling: bool = False) -> None:
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus), *(resources or {}).items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RayRollouts: {name}={value!r}: each rollout's resources are numbers >= 0")
        if memory is not None and (isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0):
            raise ValueError(f"RayRollouts: memory={memory!r}: give the bytes each rollout reserves, or None")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < -1:
            raise ValueError(f"RayRollouts: max_retries={max_retries!r}: a count >= 0, or -1 for no limit")
        reserved = {"num_cpus", "num_gpus", "memory", "resources", "max_retries", "retry_exceptions", "runtime_env"}
        if clash := sorted(reserved & set(options or {})):
            raise ValueError(f"RayRollouts: options {clash} have arguments of their own: pass them as "
                             f"RayRollouts({clash[0]}=...); retry_exceptions stays off (a rollout that raises "
                             "counts against max_exceptions)")
        self.address = address
        self.max_retries = max_retries
        self.autoscaling = autoscaling
        self.resources = {"CPU": float(num_cpus), "GPU": float(num_gpus), **(resources or {})}
        if memory is not None:
            self.resources["memory"] = float(memory)
        self._options: dict[str, Any] = {
            "num_cpus": num_cpus, "num_gpus": num_gpus, "memory": memory, "resources": dict(resources or {}),
            "max_retries": max_retries, "retry_exceptions": False, "runtime_env": dict(runtime_env or {}) or None,
            **(options or {})}
        self._task: RemoteFunction | None = None

    def connect(self) -> RemoteFunction:
        """Connect to the cluster (`ray.init`) unless this process already is, and return the task
        that runs one rollout; the first gather that uses this runner calls it."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=self.address)
        elif self.address is not None:
            logger.info("RayRollouts: Ray is already initialized in this process; using that cluster, not %s",
                        self.address)
        if self._task is None:
            self._task = ray.remote(_run_in_worker).options(**self._options)
        return self._task

    def remote(self, rollout: Rollout) -> Callable[[], Awaitable[Trajectory]]:
        """`rollout`, sent to the cluster once (one group's rollouts share it), as a zero-argument
        async callable that runs it as a Ray task each time it is called."""
        task = self.connect()
        if not self.autoscaling:
            self._check_fits()
        ray = _ray()
        try:
            sent = ray.put(rollout)
        except Exception as error:  # Ray names the object that would not pickle; we add the usual cause
            raise TypeError(
                "The rollout function cannot be sent to the Ray workers. It travels pickled with everything it "
                "refers to: build chat models, agents and clients inside the rollout function (a TrainableModel or "
                "backend may be referred to: it travels as its URL and key). Rollouts given as coroutines already "
                "created (TrajectoryGroup(rollout(s) for ...)) cannot move at all: pass "
                f"trajectory_group(lambda: rollout(s), n). What Ray found:\n{error}") from error
        return functools.partial(self._run, task, sent)

    def _check_fits(self) -> None:
        """A rollout no node can hold would wait forever: refuse it now, naming what is missing."""
        ray = _ray()
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        wanted = {name: amount for name, amount in self.resources.items() if amount > 0}
        if not any(all(node.get(name, 0.0) >= amount for name, amount in wanted.items()) for node in nodes):
            have = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(node.items()) if k in wanted) or "nothing asked"
                             for node in nodes)
            raise ValueError(f"RayRollouts: each rollout asks for {wanted}, and no live node of the cluster has that "
                             f"much (nodes: {have or 'none'}): lower num_cpus/num_gpus/memory/resources, or add a "
                             "node that has it (on an autoscaling cluster: RayRollouts(autoscaling=True))")

    async def _run(self, task: RemoteFunction, sent: ObjectRef[Rollout]) -> Trajectory:
        """Run the rollout stored as `sent` as one Ray task and return its trajectory."""
        ray = _ray()
        reference = task.remote(sent)
        try:
            return await reference
        except asyncio.CancelledError:
            # the gather was cancelled (Ctrl-C, max_exceptions, the caller): so is the remote
            # rollout, and its own cleanup (finally, async with) runs there (see _run_in_worker)
            ray.cancel(reference)
            raise
        # (a rollout that raised comes back as Ray's RayTaskError, which is also of the rollout's
        # exception type and carries the remote traceback: it goes to gather as it is)
        except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError,
                ray.exceptions.LocalRayletDiedError) as error:
            retries = "without limit" if self.max_retries == -1 else f"max_retries={self.max_retries} times"
            raise RolloutWorkerLost(
                f"the Ray worker running this rollout died ({type(error).__name__}) and Ray retried it {retries}: "
                f"raise RayRollouts(max_retries=...) if workers die for reasons that pass (a lost node, a spot "
                f"instance), or give each rollout more memory (memory=...) if it was killed for memory. "
                f"Ray said: {error}") from error

