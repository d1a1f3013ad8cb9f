"""Rollouts on a real Ray cluster: two nodes (two raylets on 127.0.0.1, one CPU each) started by
`ray.cluster_utils.Cluster`, a real backend serving the tiny model behind an API key, and the
same rollout functions run in-process for comparison. Nothing of Ray is mocked. Last, the setting
that scales the backend the workers share: the vLLM engine's parallel sizes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

# Ray turns 127.0.0.1 into the machine's outward address when it connects; with clusters "off" (its
# switch for laptops, which changes only that) the test cluster and its traffic stay on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray", reason="the Ray runner's tests need the ray extra (`make test` installs it)")

from ray.cluster_utils import Cluster  # noqa: E402

from art_backend.app import build_app  # noqa: E402
from art_backend.config import BackendSettings  # noqa: E402
from art_integrations import (  # noqa: E402
    RayRollouts,
    RemoteBackend,
    TooManyRolloutErrors,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    art_capture,
    gather_trajectories,
    gather_trajectory_groups,
    trajectory_group,
)
from tests.conftest import ServerThread, supervisor_graph  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")

API_KEY = "ray-test-key"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # a node that stops answering is declared dead after 2 missed checks 0.5 s apart (Ray's default: 5 x 3 s)
    health = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "_system_config": health})
    started.add_node(num_cpus=1)
    # pytest imports this file as a top-level module the workers cannot import: its functions
    # travel by value, as a script's `__main__` functions do
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield started
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()
    started.shutdown()


@pytest.fixture(scope="module")
def backend_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """A backend as a user runs one for a cluster: its own server, an API key required."""
    settings = BackendSettings(model="tiny-random-smollm2", engine="torch", api_key=API_KEY,
                               art_dir=tmp_path_factory.mktemp("art"))
    with ServerThread(build_app(settings)) as running:
        yield running


@pytest.fixture
async def model(backend_server: ServerThread, request: pytest.FixtureRequest) -> AsyncIterator[TrainableModel]:
    async with RemoteBackend(backend_server.base_url, api_key=API_KEY) as backend:
        trained = TrainableModel(name=request.node.name[:60].replace("[", "-").rstrip("]"), project="ray")
        await trained.register(backend)
        yield trained


def where() -> dict[str, Any]:
    return {"node": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


# ----- rollouts: the three capture paths, run in a worker or here --------------------------


async def supervisor_rollout(model: TrainableModel, topic: str, temperature: float = 0.0) -> Trajectory:
    """A LangGraph supervisor with a research subgraph (a sub-agent: an additional history), on ChatART."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from langgraph.graph import MessagesState

    from art_integrations.langchain import ChatART

    # no retries: a worker's later rollouts must find the connections its earlier ones pooled alive
    llm = ChatART.from_model(model, max_tokens=6, temperature=temperature, max_retries=0)

    async def researcher(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke([SystemMessage("You research."), state["messages"][0]])]}

    async def supervisor(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await llm.ainvoke(state["messages"])]}

    async with art_capture(topic=topic) as trajectory:
        await supervisor_graph(supervisor, researcher).ainvoke(
            {"messages": [HumanMessage(f"Find facts about {topic}.")]})
    trajectory.metadata.update(where())
    # greedy rollouts of a scenario are alike (no signal); sampled ones differ in their tokens
    trajectory.reward = sum(c.token_ids[0] for h in trajectory.histories() for c in h.choices()) % 1000 / 1000
    return trajectory


async def handler_rollout(model: TrainableModel, question: str) -> Trajectory:
    """A plain ChatOpenAI with our callback handler: tokens are fetched from the backend on capture exit."""
    from langchain_openai import ChatOpenAI

    from art_integrations.langchain import ARTCallbackHandler

    backend = model.backend
    llm = ChatOpenAI(base_url=f"{backend.base_url}/v1", api_key=backend.api_key, model=model.inference_name,
                     max_tokens=6, temperature=0, max_retries=0, extra_body={"return_token_ids": True},
                     callbacks=[ARTCallbackHandler(api_key=backend.api_key)])
    async with art_capture() as trajectory:
        await llm.ainvoke(question)
    trajectory.metadata.update(where())
    return trajectory


async def llamaindex_rollout(model: TrainableModel, question: str) -> Trajectory:
    from llama_index.core.llms import ChatMessage

    from art_integrations.llamaindex import ARTLLM

    llm = ARTLLM.from_model(model, max_tokens=6, temperature=0)
    async with art_capture() as trajectory:
        await llm.achat([ChatMessage(role="user", content=question)])
    trajectory.metadata.update(where())
    return trajectory


def turns(trajectory: Trajectory) -> list[list[tuple[list[int], list[int], list[float]]]]:
    """Each history's model turns: exact prompt ids, completion ids, logprobs."""
    return [[(c.prompt_token_ids or [], c.token_ids or [], c.token_logprobs or []) for c in history.choices()]
            for history in trajectory.histories()]


async def test_a_langgraph_group_runs_on_both_nodes_with_exact_tokens_and_trains(cluster: Cluster,
                                                                                 model: TrainableModel) -> None:
    greedy = [trajectory_group(lambda: supervisor_rollout(model, "owls"), n=2, path="ChatART"),
              trajectory_group(lambda: handler_rollout(model, "Name a bird."), n=2, path="handler"),
              trajectory_group(lambda: llamaindex_rollout(model, "Name a tree."), n=2, path="llamaindex")]
    sampled = trajectory_group(lambda: supervisor_rollout(model, "cats", temperature=1.0), n=4, path="sampled")
    runner = RayRollouts(address=cluster.address, num_cpus=1, max_retries=1)

    on_ray = await gather_trajectory_groups([*greedy, sampled], runner=runner)
    here = await gather_trajectory_groups(greedy)

    rollouts = [t for group in on_ray for t in group.trajectories]
    assert len(rollouts) == 10 and not any(group.exceptions for group in on_ray)
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2 and {t.metadata["node"] for t in rollouts} == nodes  # both nodes ran rollouts
    assert os.getpid() not in {t.metadata["pid"] for t in rollouts}
    for remote, local in zip(on_ray, here, strict=False):  # the greedy groups: same tokens wherever they ran
        for far, near in zip(remote.trajectories, local.trajectories, strict=True):
            assert not far.metrics.get("capture_errors"), far.logs
            far_turns, near_turns = turns(far), turns(near)
            assert [[(p, c) for p, c, _ in h] for h in far_turns] == [[(p, c) for p, c, _ in h] for h in near_turns]
            assert all(p and c and len(lp) == len(c) for h in far_turns for p, c, lp in h)
            assert all(a == pytest.approx(b, abs=1e-3) for fh, nh in zip(far_turns, near_turns, strict=True)
                       for (_, _, a), (_, _, b) in zip(fh, nh, strict=True))
    for group in (on_ray[0], on_ray[3]):  # the supervisor's sub-agent came back as an additional history
        assert all(len(t.additional_histories) == 1 and t.additional_histories[0].choices()[0].token_ids
                   for t in group.trajectories)
        assert all(t.metadata["additional_history_agents"] == ["researcher"] for t in group.trajectories)

    result = await model.train(on_ray, TrainConfig(learning_rate=1e-3))
    # the greedy groups' rollouts are alike (no signal); the sampled group trains
    assert result.step == 1 and result.metrics["groups/trained"] == 1
    assert result.metrics["sequences"] == 8  # 4 rollouts x (supervisor + researcher)


async def fine() -> Trajectory:
    return Trajectory(reward=1.0, metadata=where())


async def exploding() -> Trajectory:
    raise ValueError(f"tool exploded in pid {os.getpid()}")


async def test_a_rollout_that_raises_counts_against_max_exceptions(cluster: Cluster) -> None:
    runner = RayRollouts(address=cluster.address)
    groups = await gather_trajectory_groups([trajectory_group(exploding, n=2), trajectory_group(fine, n=2)],
                                            runner=runner, max_exceptions=2, progress=False)
    assert [len(group.trajectories) for group in groups] == [0, 2]
    assert len(groups[0].exceptions) == 2
    for trace in groups[0].exceptions:
        # the worker's traceback, with the rollout's own exception type and message
        assert "ValueError: tool exploded in pid" in trace and "in exploding" in trace
        assert f"pid {os.getpid()}" not in trace
    with pytest.raises(TooManyRolloutErrors, match="(?s)2 of 3 rollouts failed.*tool exploded"):
        await gather_trajectory_groups([trajectory_group(exploding, n=2), trajectory_group(fine, n=1)],
                                       runner=runner, max_exceptions=1, progress=False)
    group = await gather_trajectories(fine, 2, runner=runner)  # one group: the same runner argument
    assert len(group.trajectories) == 2 and os.getpid() not in {t.metadata["pid"] for t in group.trajectories}


async def marked_rollout(marks: Path, seconds: float) -> Trajectory:
    """Leaves a file named by its pid, then waits `seconds` unless an earlier attempt left one."""
    retried = any(marks.iterdir())
    (marks / str(os.getpid())).write_text("started")
    if not retried:
        await asyncio.sleep(seconds)
    return Trajectory(reward=1.0, metadata=where())


async def started(marks: Path, count: int, timeout: float = 240) -> list[Path]:
    deadline = time.monotonic() + timeout
    while len(found := sorted(marks.iterdir())) < count:
        assert time.monotonic() < deadline, f"{count} rollouts did not start within {timeout} s"
        await asyncio.sleep(0.05)
    return found


async def test_a_worker_killed_mid_rollout_is_retried_or_counted_as_failed(cluster: Cluster, tmp_path: Path) -> None:
    retried, counted = tmp_path / "retried", tmp_path / "counted"
    retried.mkdir(), counted.mkdir()
    gather = asyncio.ensure_future(gather_trajectory_groups(
        [trajectory_group(lambda: marked_rollout(retried, 120), n=1)],
        runner=RayRollouts(address=cluster.address, max_retries=1), progress=False))
    (first,) = await started(retried, 1)
    os.kill(int(first.name), signal.SIGKILL)
    (group,) = await asyncio.wait_for(gather, 240)
    assert len(group.trajectories) == 1 and not group.exceptions
    assert {p.name for p in retried.iterdir()} == {first.name, str(group.trajectories[0].metadata["pid"])}

    gather = asyncio.ensure_future(gather_trajectory_groups(
        [trajectory_group(lambda: marked_rollout(counted, 120), n=1), trajectory_group(fine, n=1)],
        runner=RayRollouts(address=cluster.address, max_retries=0), max_exceptions=1, progress=False))
    (killed,) = await started(counted, 1)
    os.kill(int(killed.name), signal.SIGKILL)
    lost, kept = await asyncio.wait_for(gather, 240)
    assert not lost.trajectories and len(kept.trajectories) == 1
    (trace,) = lost.exceptions
    assert "RolloutWorkerLost: the Ray worker running this rollout died (WorkerCrashedError)" in trace
    assert "max_retries=0" in trace


@pytest.mark.parametrize(("settings", "named"), [
    ({"num_cpus": -1}, "num_cpus=-1"), ({"num_gpus": True}, "num_gpus=True"), ({"resources": {"TPU": "1"}}, "TPU='1'"),
    ({"memory": 0}, "memory=0"), ({"max_retries": -2}, "max_retries=-2"),
    ({"options": {"max_retries": 5}}, r"options \['max_retries'\] have arguments of their own"),
])
def test_bad_runner_settings_are_refused_by_name(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        RayRollouts(**settings)


async def test_rollouts_that_ask_for_more_than_any_node_has_are_refused_not_left_waiting(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match=r"asks for \{'CPU': 2\.0\}, and no live node .* lower num_cpus"):
        await gather_trajectory_groups([trajectory_group(fine, n=1)],
                                       runner=RayRollouts(address=cluster.address, num_cpus=2), progress=False)


async def test_a_rollout_that_cannot_travel_is_refused_once_with_the_fix(cluster: Cluster) -> None:
    import threading

    lock = threading.Lock()

    async def holds_a_lock() -> Trajectory:
        with lock:
            return Trajectory()

    with pytest.raises(TypeError, match="cannot be sent to the Ray workers.*build chat models, agents and clients"):
        await gather_trajectory_groups([trajectory_group(holds_a_lock, n=3)],
                                       runner=RayRollouts(address=cluster.address), progress=False)
    # ART's style, coroutines already created here, cannot move at all (and are closed, never left unawaited)
    with pytest.raises(TypeError, match=r"coroutines already created .* pass trajectory_group\(lambda"):
        await gather_trajectory_groups([TrajectoryGroup(fine() for _ in range(2))],
                                       runner=RayRollouts(address=cluster.address), progress=False)


SCRIPT = '''
import asyncio, json, os, sys, time
from pathlib import Path

from art_integrations import RayRollouts, RemoteBackend, TrainableModel, Trajectory, art_capture
from art_integrations import gather_trajectory_groups, trajectory_group
from art_integrations.langchain import ChatART

ADDRESS, URL, KEY, OUT = sys.argv[1:5]
MARKS = Path(OUT) / "marks"


async def ask(model: TrainableModel) -> Trajectory:
    import ray

    async with art_capture() as trajectory:
        await ChatART.from_model(model, max_tokens=4, temperature=0).ainvoke("Name a bird.")
    trajectory.metadata["node"] = ray.get_runtime_context().get_node_id()
    return trajectory


async def waits(seconds: float) -> Trajectory:
    mark = MARKS / str(os.getpid())
    mark.write_text("started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        mark.write_text("cancelled")
        raise
    return Trajectory()


async def main() -> None:
    model = TrainableModel(name="main-script", project="ray")
    await model.register(RemoteBackend(URL, api_key=KEY))
    runner = RayRollouts(address=ADDRESS)
    (group,) = await gather_trajectory_groups([trajectory_group(lambda: ask(model), n=2)], runner=runner)
    (Path(OUT) / "result.json").write_text(group.model_dump_json())
    await gather_trajectory_groups([trajectory_group(lambda: waits(600), n=2)], runner=runner)


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        # leaving ends this driver's job and its workers: first let the cancelled rollouts clean up
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(m.read_text() != "cancelled" for m in MARKS.iterdir()):
            time.sleep(0.1)
        raise
'''


def test_a_scripts_main_rollouts_run_on_the_cluster_and_ctrl_c_cancels_them(cluster: Cluster,
                                                                            backend_server: ServerThread,
                                                                            tmp_path: Path) -> None:
    ray.init(address=cluster.address, ignore_reinit_error=True)  # for ray.nodes() below, when run alone
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "marks").mkdir()
    process = subprocess.Popen([sys.executable, str(script), cluster.address, backend_server.base_url, API_KEY,
                                str(tmp_path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300  # a bound, not a target: a loaded 2-core machine took over 120 s
        while len(list((tmp_path / "marks").iterdir())) < 2:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the script's second gather did not start two rollouts"
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)  # Ctrl-C
        try:  # a bound, not a speed check: on a loaded 2-core machine Ray's workers are slow to answer
            _, stderr = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"the script did not end within 240 s of Ctrl-C: {process.communicate()[1][-3000:]}")
    finally:
        process.kill()
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr
    assert [m.read_text() for m in (tmp_path / "marks").iterdir()] == ["cancelled", "cancelled"], stderr[-3000:]
    group = TrajectoryGroup.model_validate_json((tmp_path / "result.json").read_text())
    assert len(group.trajectories) == 2 and {t.metadata["node"] for t in group.trajectories} == {
        node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert all(c.prompt_token_ids and c.token_ids for t in group.trajectories for c in t.choices())
    assert "2/2" in stderr  # the driver's progress bar counted both remote rollouts


async def sleeps_on(node: str, marks: Path) -> Trajectory:
    """Waits as long as it runs on `node`; elsewhere it returns at once."""
    (marks / str(os.getpid())).write_text("started")
    while where()["node"] == node:
        await asyncio.sleep(1)
    return Trajectory(reward=1.0, metadata=where())


async def test_a_node_removed_mid_rollout_is_retried_on_another(cluster: Cluster, tmp_path: Path) -> None:
    # last in this module: it takes the second node away
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    (node,) = cluster.worker_nodes
    doomed = node.node_id
    first = NodeAffinitySchedulingStrategy(node_id=doomed, soft=True)  # there first, elsewhere once it is gone
    gather = asyncio.ensure_future(gather_trajectory_groups(
        [trajectory_group(lambda: sleeps_on(doomed, tmp_path), n=1)],
        runner=RayRollouts(address=cluster.address, max_retries=1, options={"scheduling_strategy": first}),
        progress=False))
    await started(tmp_path, 1)
    cluster.remove_node(node, allow_graceful=False)
    (group,) = await asyncio.wait_for(gather, 120)
    assert len(group.trajectories) == 1 and not group.exceptions
    (survivor,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert group.trajectories[0].metadata["node"] == survivor != doomed


# ----- the backend the workers share ---------------------------------------------------------


def test_the_vllm_engines_parallel_sizes_pass_through_and_bad_ones_are_refused_by_name(tiny_model_dir: Path) -> None:
    import torch

    from art_backend.engine.vllm_args import vllm_engine_args

    if torch.cuda.is_available():
        pytest.skip("on a GPU the sizes are also checked against the GPUs this process sees")
    args = vllm_engine_args(tiny_model_dir, "tiny", tensor_parallel_size=2, data_parallel_size=4)
    assert (args["tensor_parallel_size"], args["data_parallel_size"]) == (2, 4)
    with pytest.raises(ValueError, match="data_parallel_size=0: a whole number"):
        vllm_engine_args(tiny_model_dir, "tiny", data_parallel_size=0)
    for option in ("--tensor-parallel-size", "--data-parallel-size"):
        result = subprocess.run([sys.executable, "-m", "art_backend", "serve", option, "0"], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2 and option[2:].replace("-", "_") in result.stderr
