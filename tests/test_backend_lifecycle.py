"""The backend's life around the training routes (tiny model): two clients of one server training
one model, refusals naming what is wrong, a backend in a child process, a script that ends without
closing, and a remote backend behind an API key. None of it depends on the engine's kernels, so
`make test` runs these once (tests/test_training_backend.py is an engine contract test, run on each
engine and once more on the eager path)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from art_integrations import (BackendError, LocalBackend, RemoteBackend, TrainableModel, TrainConfig, Trajectory,
                              TrajectoryGroup)
from tests.conftest import checkout_env, scored_group

TINY = "tiny-random-smollm2"


async def test_two_clients_training_one_model_are_serialized_not_interleaved(tmp_path: Path) -> None:
    """Two scripts (here two clients of one server) training the same model name at once: each
    step trains on its own groups from the step before it, one after the other."""
    art_dir = tmp_path / ".art"
    backend = LocalBackend(model=TINY, engine="torch", art_dir=art_dir)
    other = RemoteBackend(backend.base_url)
    try:
        first, second = TrainableModel(name="agent", project="demo"), TrainableModel(name="agent", project="demo")
        await first.register(backend)
        await second.register(other)
        first_groups = [await scored_group(first, "first client", [0.0, 1.0])]
        second_groups = [await scored_group(second, "second client", [0.0, 0.5])]
        results = await asyncio.gather(first.train(first_groups, TrainConfig(learning_rate=1e-3)),
                                       second.train(second_groups, TrainConfig(learning_rate=1e-3)))

        assert sorted(r.step for r in results) == [1, 2]
        directory = art_dir / "demo" / "models" / "agent"
        history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
        by_step = {record["step"]: record for record in history if record["split"] == "train"}
        for result, mean in zip(results, (0.5, 0.25)):  # each step recorded with its own client's groups
            assert by_step[result.step]["reward/mean"] == pytest.approx(mean)
        for step in (1, 2):  # step 2 continued step 1's optimizer: the steps ran one after the other
            optimizer = torch.load(directory / "checkpoints" / f"{step:04d}" / "optimizer.pt", weights_only=True)
            assert {float(s["step"]) for s in optimizer["state"].values()} == {float(step)}
    finally:
        await other.close()
        await backend.close()


async def test_missing_token_ids_get_a_clear_error(tmp_path: Path) -> None:
    async with LocalBackend(model=TINY, art_dir=tmp_path) as backend:
        model = TrainableModel(name="m", project="p")
        await model.register(backend)
        group = TrajectoryGroup(trajectories=[
            Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                             {"message": {"role": "assistant", "content": "a"}}], reward=r)
            for r in (0.0, 1.0)])
        with pytest.raises(BackendError, match="return_token_ids"):
            await model.train([group])
        with pytest.raises(BackendError, match="not registered"):
            await backend.request("GET", "/v1/training/models/p/other/step")
        with pytest.raises(BackendError, match="serves 'tiny-random-smollm2'"):
            await TrainableModel(name="x", project="p", base_model="Qwen/Qwen3-8B").register(backend)


async def test_backend_in_a_child_process_starts_and_stops(tmp_path: Path) -> None:
    backend = LocalBackend(in_process=False, model=TINY, art_dir=tmp_path)
    process = backend._process
    assert process is not None and backend.pid == process.pid  # what benchmarks watch the memory of
    assert Path(f"/proc/{backend.pid}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-m", b"art_backend", b"serve"]
    model = TrainableModel(name="child", project="p")
    await model.register(backend)
    assert await model.get_step() == 0
    await backend.close()
    assert process.returncode is not None and backend.pid is None


# leaves asyncio.run with a reply still decoding and the backend never closed
_SCRIPT_WITHOUT_CLOSE = """
import asyncio, sys
from art_integrations import LocalBackend

async def main() -> None:
    backend = LocalBackend(model="tiny-random-smollm2", art_dir=sys.argv[1], in_process=sys.argv[2] == "in")
    stream = await backend.openai_client().chat.completions.create(
        model="tiny-random-smollm2", stream=True, max_tokens=1500, messages=[{"role": "user", "content": "Count."}])
    async for _ in stream:
        break
    print(backend.pid)

asyncio.run(main())
"""


@pytest.mark.parametrize("where", ["in", "child"])
def test_a_script_ending_without_close_exits_cleanly_and_stops_its_server(tmp_path: Path, where: str) -> None:
    """Before the backend stopped itself at exit, the in-process engine was still decoding on its
    daemon thread while Python finalized, and its next torch call aborted the process ("terminate
    called without an active exception", 5 runs in 6); a child server outlived the script."""
    ran = subprocess.run([sys.executable, "-c", _SCRIPT_WITHOUT_CLOSE, str(tmp_path / "art"), where],
                         env=checkout_env(ART_BACKEND_CPU_KERNELS="false"),
                         capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    if where == "child":
        assert not Path(f"/proc/{int(ran.stdout.split()[-1])}").exists()


# a script killed where neither close() nor an exit hook can run: SIGKILL (a job scheduler's, the IDE's stop)
_SCRIPT_KILLED = """
import os, signal, sys
from art_integrations import LocalBackend

backend = LocalBackend(model="tiny-random-smollm2", art_dir=sys.argv[1])
print("server pid", backend.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (reparented, nobody may reap it in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_script_leaves_no_server_behind(tmp_path: Path) -> None:
    """A LocalBackend's server outlived a script killed by SIGKILL (or by SIGTERM, which runs no
    exit hook), decoding on for nobody: it now stops once the script is gone."""
    output = tmp_path / "output.txt"  # not a pipe: a server left behind would hold it open
    with output.open("wb") as file:
        ran = subprocess.run([sys.executable, "-c", _SCRIPT_KILLED, str(tmp_path / "art")],
                             env=checkout_env(ART_BACKEND_CPU_KERNELS="false"), stdout=file, stderr=subprocess.STDOUT,
                             timeout=120, check=False)
    assert ran.returncode == -9, output.read_text()[-3000:]
    server = int(re.search(r"server pid (\d+)", output.read_text())[1])
    deadline = time.monotonic() + 60
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    if _running(server):
        os.kill(server, signal.SIGKILL)
        pytest.fail(f"the server (pid {server}) was still running 60 s after the script that started it was killed")


async def test_remote_backend_with_an_api_key(tiny_engine, tmp_path: Path) -> None:
    from art_backend.server import create_app
    from art_backend.training.service import TrainingService
    from tests.conftest import ServerThread

    app = create_app(tiny_engine, api_key="k3y", training=TrainingService(tiny_engine, tmp_path))
    with ServerThread(app) as running:
        async with RemoteBackend(f"{running.base_url}/v1", api_key="k3y") as backend:
            model = TrainableModel(name="remote", project="p")
            await model.register(backend)
            assert await model.get_step() == 0
            reply = await model.openai_client().chat.completions.create(
                model=model.inference_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert reply.choices[0].finish_reason in ("stop", "length")
        async with RemoteBackend(running.base_url, api_key="wrong") as intruder:
            with pytest.raises(BackendError, match="401"):
                await TrainableModel(name="x", project="p").register(intruder)
