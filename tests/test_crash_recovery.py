"""Crash recovery, as an operator would check it: a real backend process is killed with SIGKILL
at each moment of a train step (and during rollouts, and between steps), restarted on the same
art dir, and what it serves and stores is checked; damaged checkpoints are refused by name and
fallen back from only when asked; a torn history line is skipped and never glues; a server
error leaves the client's kept-alive connection usable."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from art_backend.kill_points import MOMENTS
from art_backend.server import create_app
from art_backend.training.checkpoints import checkpoint_problem
from art_backend.training.service import TrainingService
from art_integrations import BackendError, RemoteBackend, TrainableModel, TrainConfig, Trajectory, TrainSFTConfig
from art_integrations.wire import free_loopback_port
from tests.conftest import ServerThread, scored_group

TINY = "tiny-random-smollm2"
AFTER_COMMIT = ("step_committed", "history_appended", "step_published")  # the step exists once restarted
CONFIG = TrainConfig(learning_rate=1e-3)
RECOVERY_PASSES = "history_appended"  # the kill point in publishing a step, which a restart's recovery runs too


@contextmanager
def backend_process(art_dir: Path, kill_at: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`art-backend serve` on the tiny model, as a process of its own; up when yielded."""
    port = free_loopback_port()
    env = {key: value for key, value in os.environ.items() if key != "ART_TEST_KILL_AT"}
    if kill_at is not None:
        env["ART_TEST_KILL_AT"] = kill_at
    log = (art_dir.parent / f"backend-{port}.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "art_backend", "serve", "--model", TINY, "--art-dir",
                                str(art_dir), "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    process.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, log.name
            try:
                if httpx.get(f"{process.url}/health", timeout=2).status_code == 200:  # type: ignore[attr-defined]
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"the backend did not start; see {log.name}"
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=60)
        log.close()


def _killed(process: subprocess.Popen[bytes]) -> None:
    assert process.wait(timeout=120) == -signal.SIGKILL


async def _registered(process: subprocess.Popen[bytes], name: str = "agent",
                      **register: Any) -> tuple[RemoteBackend, TrainableModel]:
    backend = RemoteBackend(process.url)  # type: ignore[attr-defined]
    model = TrainableModel(name=name, project="crash")
    await model.register(backend, **register)
    return backend, model


def _check_stored(art_dir: Path, steps: int, name: str = "agent") -> None:
    """What the operator checked on disk after each restart."""
    directory = art_dir / "crash" / "models" / name
    checkpoints = directory / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".damaged")) == \
        [f"{step:04d}" for step in range(1, steps + 1)]  # no staging or half-deleted leftovers
    for step in range(1, steps + 1):
        assert checkpoint_problem(checkpoints / f"{step:04d}") is None
        assert (directory / "trajectories" / "train" / f"{step:04d}.jsonl").is_file()
    records = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "train"] == list(range(1, steps + 1))
    optimizer = torch.load(checkpoints / f"{steps:04d}" / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {float(steps)}


async def _greedy_logprob(model: TrainableModel, served: str) -> float:
    reply = await model.openai_client().chat.completions.create(
        model=served, messages=[{"role": "user", "content": "x"}], max_tokens=1, temperature=0, logprobs=True)
    return reply.choices[0].logprobs.content[0].logprob


async def _killed_by_its_train_step(process: subprocess.Popen[bytes], model: TrainableModel,
                                    groups: list[Any]) -> None:
    with pytest.raises(BackendError, match="connection broke"):
        await model.train(groups, CONFIG)
    _killed(process)


async def test_a_backend_killed_at_any_moment_recovers_every_acknowledged_step(tmp_path: Path) -> None:
    """Each restart checks what the kill before it left, and, started with the next moment to kill
    at, is killed by its own next train step: one start per moment."""
    art_dir = tmp_path / ".art"
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        groups = [await scored_group(model, "a", [0.0, 1.0, 0.5])]
        assert (await model.train(groups, CONFIG)).step == 1
        first = await _greedy_logprob(model, "agent@1")
        await backend.close()
    with backend_process(art_dir, kill_at=MOMENTS[0]) as process:
        backend, model = await _registered(process)
        await _killed_by_its_train_step(process, model, groups)
        await backend.close()
    acknowledged = 1
    for moment, next_moment in zip(MOMENTS, [*MOMENTS[1:], None]):
        # a restart after a kill at step_committed publishes the step itself, passing RECOVERY_PASSES
        recovering_at = None if next_moment == RECOVERY_PASSES else next_moment
        with backend_process(art_dir, kill_at=recovering_at) as process:
            backend, model = await _registered(process)
            step = await model.get_step()
            assert step == acknowledged + (moment in AFTER_COMMIT), moment
            _check_stored(art_dir, step)
            served = {m.id for m in (await model.openai_client().models.list()).data}
            assert {f"agent@{s}" for s in range(step + 1)} | {"agent"} <= served
            assert await _greedy_logprob(model, "agent@1") == pytest.approx(first, abs=1e-5)
            acknowledged = step
            if next_moment is not None and next_moment != RECOVERY_PASSES:
                await _killed_by_its_train_step(process, model, groups)
                await backend.close()
                continue
            if next_moment is not None:  # a process of its own for this one
                await backend.close()
                process.terminate()
                process.wait(timeout=60)
                with backend_process(art_dir, kill_at=next_moment) as killed:
                    backend, model = await _registered(killed)
                    await _killed_by_its_train_step(killed, model, groups)
                    await backend.close()
                continue
            # the last restart (no kill moment) continues by exactly one step, then is killed during
            # rollouts, and the next one between steps: nothing acknowledged is lost
            assert (await model.train(groups, CONFIG)).step == step + 1
            acknowledged = step + 1
            client = model.openai_client(max_retries=0)
            started = [asyncio.Event() for _ in range(8)]

            async def rollout(i: int) -> None:
                stream = await client.chat.completions.create(
                    model="agent", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=1500, stream=True,
                    extra_body={"ignore_eos": True})
                async for _ in stream:
                    started[i].set()

            rollouts = [asyncio.create_task(rollout(i)) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
            process.send_signal(signal.SIGKILL)  # every rollout is mid-generation
            _killed(process)
            assert all(isinstance(r, Exception) for r in await asyncio.gather(*rollouts, return_exceptions=True))
            await backend.close()
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        assert await model.get_step() == acknowledged
        assert (await model.train(groups, CONFIG)).step == acknowledged + 1
        process.send_signal(signal.SIGKILL)
        _killed(process)
        await backend.close()
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        assert await model.get_step() == acknowledged + 1
        _check_stored(art_dir, acknowledged + 1)
        await backend.close()


async def test_an_sft_step_killed_midway_is_rolled_back_and_one_killed_once_committed_is_recovered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An SFT step (train_sft) commits as a GRPO step does: killed while its checkpoint is written,
    a restart rolls it back; killed once committed, a restart publishes and serves it."""
    # no fused decode kernels: building them would take most of each of the three starts, and
    # what is checked here is the step on disk, not decoding
    monkeypatch.setenv("ART_BACKEND_CPU_KERNELS", "false")
    art_dir = tmp_path / ".art"
    demonstrations = [Trajectory(messages_and_choices=[{"role": "user", "content": "Code word?"},
                                                       {"role": "assistant", "content": "pineapple"}])] * 2
    config = TrainSFTConfig(learning_rate=1e-3, batch_size=1)  # two optimizer steps in the one step
    for kill_at, step_after in (("checkpoint_half_written", 0), ("step_committed", 0)):
        with backend_process(art_dir, kill_at=kill_at) as process:
            backend, model = await _registered(process)
            assert await model.get_step() == step_after
            with pytest.raises(BackendError, match="connection broke"):
                await model.train_sft(demonstrations, config)
            _killed(process)
            await backend.close()
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        assert await model.get_step() == 1
        directory = art_dir / "crash" / "models" / "agent"
        assert sorted(p.name for p in (directory / "checkpoints").iterdir()) == ["0001"]
        [record] = [r for r in await model.history() if r["split"] == "train"]
        assert record["step"] == 1 and record["kind"] == "sft" and record["optimizer_steps"] == 2
        assert (directory / "trajectories" / "train" / "0001.jsonl").is_file()
        assert "agent@1" in {m.id for m in (await model.openai_client().models.list()).data}
        optimizer = torch.load(directory / "checkpoints" / "0001" / "optimizer.pt", weights_only=True)
        assert {float(s["step"]) for s in optimizer["state"].values()} == {2.0}
        await backend.close()


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    "adapter truncated": ("adapter_model.safetensors", _truncate),
    "adapter empty": ("adapter_model.safetensors", lambda path: path.write_bytes(b"")),
    "adapter missing": ("adapter_model.safetensors", Path.unlink),
    "optimizer state truncated": ("optimizer.pt", _truncate),
    "optimizer state missing": ("optimizer.pt", Path.unlink),
}


async def test_a_damaged_checkpoint_is_refused_by_name_and_fallen_back_from_only_when_asked(tmp_path: Path) -> None:
    """One model per kind of damage, all in one art dir: a restart meets them all."""
    art_dir = tmp_path / ".art"
    names = {damage: damage.replace(" ", "-") for damage in DAMAGES}
    with backend_process(art_dir) as process:
        for name in names.values():
            backend, model = await _registered(process, name)
            groups = [await scored_group(model, "a", [0.0, 1.0, 0.5])]
            for step in (1, 2):
                assert (await model.train(groups, CONFIG)).step == step
            await backend.close()
    for damage, (file, spoil) in DAMAGES.items():
        spoil(art_dir / "crash" / "models" / names[damage] / "checkpoints" / "0002" / file)
    with backend_process(art_dir) as process:
        for damage, (file, _) in DAMAGES.items():
            name = names[damage]
            with pytest.raises(BackendError, match=rf"\(409\): Step 2 of crash/{name} does not load.*0002/{file}"):
                await _registered(process, name)
            backend = RemoteBackend(process.url)  # type: ignore[attr-defined]
            with pytest.raises(BackendError, match="not registered"):  # so it can never train from scratch
                await backend.request("POST", f"/v1/training/models/crash/{name}/train",
                                      {"groups": [group.model_dump(mode="json") for group in groups]})
            model = TrainableModel(name=name, project="crash")
            await model.register(backend, fall_back=True)
            assert await model.get_step() == 1, damage
            checkpoints = art_dir / "crash" / "models" / name / "checkpoints"
            assert (checkpoints / ".damaged-0002" / "adapter_config.json").is_file()  # kept for a look
            assert (await model.history())[-1] == {**(await model.history())[-1], "split": "fall_back",
                                                   "step": 1, "moved_aside": [2]}
            assert (await model.train(groups, CONFIG)).step == 2  # from step 1's adapter and optimizer
            _check_stored(art_dir, 2, name)
            await backend.close()


async def test_a_torn_history_line_is_skipped_and_never_swallows_the_next(tmp_path: Path) -> None:
    art_dir = tmp_path / ".art"
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        groups = [await scored_group(model, "a", [0.0, 1.0])]
        await model.train(groups, CONFIG)
        await backend.close()
    history = art_dir / "crash" / "models" / "agent" / "history.jsonl"
    with history.open("ab") as out:
        out.write(b'{"step": 1, "split": "val", "reward/me')  # what a kill mid-append leaves
    with backend_process(art_dir) as process:
        backend, model = await _registered(process)
        assert [r["split"] for r in await model.history()] == ["train"]
        assert (await model.train(groups, CONFIG)).step == 2
        await model.log(groups, split="val")
        assert [(r["step"], r["split"]) for r in await model.history()] == [(1, "train"), (2, "train"), (2, "val")]
        await backend.close()
    lines = history.read_text().splitlines()
    assert lines[1] == '{"step": 1, "split": "val", "reward/me' and json.loads(lines[2])["step"] == 2


def test_a_server_error_leaves_the_kept_alive_connection_usable(tiny_engine: Any, tmp_path: Path) -> None:
    not_a_directory = tmp_path / "art-dir-is-a-file"
    not_a_directory.write_text("")
    app = create_app(tiny_engine, training=TrainingService(tiny_engine, not_a_directory))
    with ServerThread(app) as running, httpx.Client(base_url=running.base_url) as client:
        failed = client.post("/v1/training/models", json={"project": "p", "name": "m"})
        assert failed.status_code == 500 and "art-dir-is-a-file" in failed.json()["error"]["message"]
        connection = failed.extensions["network_stream"].get_extra_info("client_addr")
        after = client.get("/health")
        assert after.status_code == 200
        assert after.extensions["network_stream"].get_extra_info("client_addr") == connection


async def test_a_failed_request_names_the_servers_error_not_an_unreachable_backend(tiny_engine: Any,
                                                                                   tmp_path: Path) -> None:
    not_a_directory = tmp_path / "art-dir-is-a-file"
    not_a_directory.write_text("")
    app = create_app(tiny_engine, training=TrainingService(tiny_engine, not_a_directory))
    with ServerThread(app) as running:
        async with RemoteBackend(running.base_url) as backend:
            for _ in range(3):
                with pytest.raises(BackendError, match=r"failed \(500\): .*art-dir-is-a-file"):
                    await TrainableModel(name="m", project="p").register(backend)
    async with RemoteBackend(f"http://127.0.0.1:{free_loopback_port()}") as nobody:
        with pytest.raises(BackendError, match="Cannot reach the backend"):
            await TrainableModel(name="m", project="p").register(nobody)

