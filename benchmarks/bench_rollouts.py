"""Rollouts per second in-process against a local Ray cluster of one and of two nodes, and what
Ray adds to one rollout.

A rollout here is an agent's environment without its model: `--tools` tool calls (default 4) of
`--tool-ms` each (default 200), returning a trajectory as big as a real one (each turn with
1,000 prompt and 50 completion token ids and their logprobs), so that sending it back costs what
it costs in use. Two environments:
  cpu   each tool call burns its time in plain Python (the GIL held: one core per process);
  wait  each tool call waits (I/O, a remote service) and does no CPU work.
Systems: `gather_trajectory_groups` in this process (every rollout on one event loop), and with
`runner=RayRollouts(...)` on a `ray.cluster_utils.Cluster` on 127.0.0.1 whose two nodes have one
CPU each: "one node" pins every rollout to the head node (a custom resource only it has), "two
nodes" lets them spread. The machine has 2 cores.

Tables (each repeat runs every system once, side by side, so a noisy machine's drift hits all
alike; medians over --repeats, after one warm-up round that starts the workers):
  1. cpu: --rollouts rollouts at once; rollouts/s and the ratio to in-process (target: >= 1.8x
     with two nodes).
  2. wait: rollouts one at a time (max_concurrency=1); seconds per rollout and what Ray adds
     (target: < 5%).
  3. many workers, one backend: K rollouts at once (K = 1, 8, 16), each 4 ChatART calls of 32
     tokens (an agent's turns) inside `art_capture()` to a backend serving the embedded model (a
     child process); completion tokens/s and the mean time of one call, when the K rollouts run
     in this process and when they run in K Ray workers. If our front end served the workers'
     requests one at a time, a call among 16 would take ~16 times a lone call; it should take
     what it takes among 16 in-process (the engine batching them).

    .venv/bin/python benchmarks/bench_rollouts.py [--repeats 3] [--rollouts 8] [--tool-ms 200] [--no-backend]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable

# keep the cluster on loopback: Ray otherwise swaps 127.0.0.1 for the machine's outward address
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from art_integrations import (  # noqa: E402
    Choice,
    LocalBackend,
    RayRollouts,
    TrainableModel,
    Trajectory,
    art_capture,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.gather import RolloutRunner  # noqa: E402

HEAD_ONLY = "bench_head"  # a custom resource only the head node has: "one node" asks for a sliver of it
PROMPT_TOKENS, COMPLETION_TOKENS = 1000, 50
BACKEND_CONCURRENCY = (1, 8, 16)
BACKEND_TOKENS, BACKEND_CALLS = 32, 4
Rollout = Callable[[], Awaitable[Trajectory]]


def burn(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time in plain Python."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(2000))


def trajectory(turns: int) -> Trajectory:
    """As big as a captured one: per turn 1,000 prompt ids, 50 completion ids and their logprobs."""
    choices = [Choice(message={"role": "assistant", "content": "x" * 200}, finish_reason="stop",
                      prompt_token_ids=list(range(PROMPT_TOKENS)), token_ids=list(range(COMPLETION_TOKENS)),
                      logprobs={"content": [{"token": "", "logprob": -0.5}] * COMPLETION_TOKENS})
               for _ in range(turns)]
    return Trajectory(messages_and_choices=[{"role": "user", "content": "task"}, *choices], reward=1.0)


async def cpu_rollout(tools: int, tool_seconds: float) -> Trajectory:
    for _ in range(tools):
        burn(tool_seconds)
        await asyncio.sleep(0)  # the model's turn: here, nothing
    return trajectory(tools)


async def wait_rollout(tools: int, tool_seconds: float) -> Trajectory:
    for _ in range(tools):
        await asyncio.sleep(tool_seconds)
    return trajectory(tools)


async def model_rollout(model: TrainableModel) -> Trajectory:
    from art_integrations.langchain import ChatART

    llm = ChatART.from_model(model, max_tokens=BACKEND_TOKENS, temperature=1.0)
    seconds = []
    async with art_capture() as captured:
        for _ in range(BACKEND_CALLS):
            started = time.perf_counter()
            # ignore_eos: every reply is exactly BACKEND_TOKENS long, so rounds compare
            await llm.ainvoke("Tell me about the sea.", extra_body={"return_token_ids": True, "ignore_eos": True})
            seconds.append(time.perf_counter() - started)
    captured.metrics["call_seconds"] = statistics.fmean(seconds)
    return captured


async def gathered(rollout: Rollout, n: int, runner: RolloutRunner | None,
                   max_concurrency: int | None = None) -> tuple[float, list[Trajectory]]:
    """Seconds to run `n` rollouts (one gather), and their trajectories; every one must succeed."""
    started = time.perf_counter()
    (group,) = await gather_trajectory_groups([trajectory_group(rollout, n)], runner=runner,
                                              max_concurrency=max_concurrency, progress=False)
    elapsed = time.perf_counter() - started
    if group.exceptions or len(group.trajectories) != n:
        raise RuntimeError(f"{len(group.exceptions)} rollouts failed; the first:\n{group.exceptions[:1]}")
    return elapsed, group.trajectories


async def timed(rollout: Rollout, n: int, runner: RolloutRunner | None, max_concurrency: int | None = None) -> float:
    return (await gathered(rollout, n, runner, max_concurrency))[0]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


async def bench_environments(args: argparse.Namespace, systems: dict[str, RolloutRunner | None]) -> None:
    seconds = args.tool_ms / 1000
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    wait: dict[str, list[float]] = {name: [] for name in systems}
    for repeat in range(args.repeats + 1):  # round 0 warms the workers up and is not counted
        rates = {}
        for name, runner in systems.items():
            rates[name] = args.rollouts / await timed(lambda: cpu_rollout(args.tools, seconds), args.rollouts, runner)
            per_rollout = await timed(lambda: wait_rollout(args.tools, seconds), args.sequential, runner,
                                      max_concurrency=1) / args.sequential
            if repeat:
                cpu[name].append(rates[name])
                wait[name].append(per_rollout)
        print(f"repeat {repeat}{'' if repeat else ' (warm-up)'}: cpu rollouts/s "
              + ", ".join(f"{name} {rate:.2f}" for name, rate in rates.items()), flush=True)
    base_rate = statistics.median(cpu["in-process"])
    table(f"cpu: {args.rollouts} rollouts at once, {args.tools} tool calls of {args.tool_ms} ms CPU each "
          f"(medians of {args.repeats})", ["system", "rollouts/s", "vs in-process"],
          [[name, f"{statistics.median(v):.2f}", f"{statistics.median(v) / base_rate:.2f}x"]
           for name, v in cpu.items()])
    base_time = statistics.median(wait["in-process"])
    table(f"wait: one rollout at a time, {args.tools} waits of {args.tool_ms} ms (medians of {args.repeats})",
          ["system", "s per rollout", "added by Ray", "added"],
          [[name, f"{statistics.median(v):.3f}", f"{(statistics.median(v) - base_time) * 1000:+.1f} ms",
            f"{(statistics.median(v) / base_time - 1) * 100:+.1f}%"] for name, v in wait.items()])


async def bench_backend(args: argparse.Namespace, runner: RolloutRunner) -> None:
    log = tempfile.NamedTemporaryFile(prefix="bench-rollouts-", suffix=".log", delete=False)
    backend = LocalBackend(in_process=False, art_dir=tempfile.mkdtemp(), log_file=log.name)
    try:
        model = TrainableModel(name="bench", project="bench-rollouts")
        await model.register(backend)
        rates: dict[tuple[int, str], list[float]] = {}
        calls: dict[tuple[int, str], list[float]] = {}
        for repeat in range(args.repeats + 1):
            for k in BACKEND_CONCURRENCY:
                for name, where in (("in-process", None), ("Ray", runner)):
                    elapsed, trajectories = await gathered(lambda: model_rollout(model), k, where)
                    if repeat:
                        rates.setdefault((k, name), []).append(k * BACKEND_CALLS * BACKEND_TOKENS / elapsed)
                        calls.setdefault((k, name), []).append(
                            statistics.fmean(t.metrics["call_seconds"] for t in trajectories))
            print(f"backend repeat {repeat}{'' if repeat else ' (warm-up)'} done", flush=True)
        rows = []
        for k in BACKEND_CONCURRENCY:
            here, far = (statistics.median(rates[(k, name)]) for name in ("in-process", "Ray"))
            rows.append([str(k), f"{here:.1f}", f"{far:.1f}", f"{far / here:.2f}",
                         *(f"{statistics.median(calls[(k, name)]):.3f}" for name in ("in-process", "Ray"))])
        table(f"many workers, one backend: K rollouts at once, {BACKEND_CALLS} ChatART calls of {BACKEND_TOKENS} "
              f"tokens each, the embedded model on the torch engine (medians of {args.repeats})",
              ["K", "tok/s, K in this process", "tok/s, K Ray workers", "Ray / in-process",
               "s per call, in-process", "s per call, Ray"], rows)
    finally:
        await backend.close()


def local_cluster(head: dict[str, object]) -> Cluster:
    """Two nodes of one CPU each on 127.0.0.1, this process connected."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False, **head})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


async def main(args: argparse.Namespace) -> None:
    cluster = local_cluster({"resources": {HEAD_ONLY: 1}})
    try:
        systems: dict[str, RolloutRunner | None] = {
            "in-process": None,
            "Ray, one node": RayRollouts(num_cpus=1, resources={HEAD_ONLY: 0.001}),
            "Ray, two nodes": RayRollouts(num_cpus=1),
        }
        await bench_environments(args, systems)
    finally:
        ray.shutdown()
        cluster.shutdown()
    if not args.backend:
        return
    # Ray keeps idle workers up to one per CPU and ends the others after 1 s: table 3's 16 workers on
    # 2 CPUs would then start again (and import LangChain again) every round. A cluster meant for many
    # light rollouts raises this limit the same way (docs/scaling.md). Its own cluster: with the
    # limit raised, Ray starts spare workers, whose start would eat into tables 1 and 2's CPU.
    cluster = local_cluster({"_system_config": {"num_workers_soft_limit": max(BACKEND_CONCURRENCY)}})
    try:
        # workers mostly wait on the model: a tenth of a CPU each lets all 16 run at once on 2 CPUs
        await bench_backend(args, RayRollouts(num_cpus=0.1))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=8, help="cpu: rollouts at once per round")
    parser.add_argument("--sequential", type=int, default=4, help="wait: rollouts one after another per round")
    parser.add_argument("--tools", type=int, default=4, help="tool calls per rollout")
    parser.add_argument("--tool-ms", type=float, default=200, help="each tool call's CPU time or wait")
    parser.add_argument("--no-backend", dest="backend", action="store_false",
                        help="skip table 3 (needs the embedded model)")
    asyncio.run(main(parser.parse_args()))
