"""Training through the user's API against real backends (tiny model): checkpoints, serving
(on each engine), history, resuming after a restart, and a backend in a child process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from art_integrations import (BackendError, GatheredGroups, LocalBackend, RemoteBackend, TrainableModel, TrainConfig,
                              Trajectory, TrajectoryGroup)
from tests.conftest import ENGINES, checkout_env, scored_group

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


@pytest.mark.parametrize("engine", ENGINES)
async def test_train_writes_a_checkpoint_serves_it_and_resumes_after_restart(tmp_path: Path, engine: str) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    art_dir = tmp_path / ".art"
    backend = LocalBackend(model=TINY, engine=engine, art_dir=art_dir)
    try:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        assert await model.get_step() == 0
        groups = [await scored_group(model, "a", [0.0, 1.0, 0.5]), await scored_group(model, "b", [1.0, 1.0, 1.0])]

        # inference keeps working while the step trains
        client = model.openai_client()
        during = [client.chat.completions.create(model=model.inference_name, max_tokens=4,
                                                 messages=[{"role": "user", "content": f"hi {i}"}]) for i in range(4)]
        result, *answers = await asyncio.gather(model.train(groups, TrainConfig(learning_rate=1e-3)), *during)
        assert all(a.choices[0].finish_reason in ("stop", "length") for a in answers)

        assert result.step == 1 and await model.get_step() == 1
        metrics = result.metrics
        assert metrics["groups/trained"] == 1 and metrics["groups/skipped_zero_variance"] == 1
        assert metrics["groups/signal_share"] == 0.5
        assert metrics["tokens/assistant"] > 0 and metrics["grad_norm"] > 0
        for key in ("reward/mean", "reward/std", "loss", "entropy", "kl", "seconds", "metrics/length"):
            assert key in metrics
        directory = art_dir / "demo" / "models" / "agent"
        checkpoint = directory / "checkpoints" / "0001"
        assert {p.name for p in checkpoint.iterdir()} >= {"adapter_model.safetensors", "adapter_config.json",
                                                          "optimizer.pt"}
        history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
        assert history[-1]["step"] == 1 and history[-1]["split"] == "train"
        stored = (directory / "trajectories" / "train" / "0001.jsonl").read_text().splitlines()
        assert len(stored) == 2 and TrajectoryGroup.model_validate_json(stored[0]).trajectories[0].reward == 0.0

        served = {m.id for m in (await client.models.list()).data}
        assert {"agent", "agent@0", "agent@1"} <= served
        base = await client.chat.completions.create(model="agent@0", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=4, temperature=0, logprobs=True)
        tuned = await client.chat.completions.create(model="agent@1", messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=4, temperature=0, logprobs=True)
        assert base.choices[0].logprobs.content[0].logprob != tuned.choices[0].logprobs.content[0].logprob

        # a step without signal is still a step: recorded, served, the adapter unchanged
        nothing = await model.train([groups[1]])
        assert nothing.step == 2 and nothing.metrics["trained"] is False and "equal rewards" in nothing.metrics["note"]
        assert nothing.metrics["groups/trained"] == 0 and nothing.metrics["reward/mean"] == 1.0
        history = [json.loads(line) for line in (directory / "history.jsonl").read_text().splitlines()]
        assert history[-1]["step"] == 2 and history[-1]["groups/trained"] == 0
        same = await client.chat.completions.create(model="agent@2", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=4, temperature=0, logprobs=True)
        assert [t.logprob for t in same.choices[0].logprobs.content] == pytest.approx(
            [t.logprob for t in tuned.choices[0].logprobs.content], abs=1e-5)
        for name in ("adapter_model.safetensors", "optimizer.pt"):
            assert (directory / "checkpoints" / "0002" / name).stat().st_size == (checkpoint / name).stat().st_size

        val = await model.log(groups, split="val")
        assert val["reward/mean"] == pytest.approx(4.5 / 6)
    finally:
        await backend.close()

    restarted = LocalBackend(model=TINY, engine=engine, art_dir=art_dir)
    try:
        model = TrainableModel(name="agent", project="demo")
        await model.register(restarted)
        assert await model.get_step() == 2
        again = await model.openai_client().chat.completions.create(  # every step is served again, unchanged
            model="agent@1", messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0, logprobs=True)
        assert again.choices[0].logprobs.content[0].logprob == pytest.approx(
            tuned.choices[0].logprobs.content[0].logprob, abs=1e-4)
        gathered = GatheredGroups([await scored_group(model, "c", [0.0, 1.0])])
        gathered.dropped = [{"group": 1, "metadata": {}, "reason": "judge failed: no score for t2", "trajectories": 2}]
        result = await model.train(gathered, TrainConfig(learning_rate=1e-3))
        assert result.step == 3
        assert result.metrics["groups/dropped"] == 1
        assert (await model.history())[-1]["dropped_reasons"] == ["judge failed: no score for t2"]
        optimizer = torch.load(art_dir / "demo" / "models" / "agent" / "checkpoints" / "0003" / "optimizer.pt")
        assert {float(s["step"]) for s in optimizer["state"].values()} == {2.0}  # Adam state carried over (2 steps)

        deleted = await model.delete_checkpoints(best_metric="reward/mean", best_split="val")
        assert deleted == {"deleted": [1], "kept": [2, 3]}  # step 2 is the best validated, 3 the latest
    finally:
        await restarted.close()


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
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    if where == "child":
        assert not Path(f"/proc/{int(ran.stdout.split()[-1])}").exists()


async def test_remote_backend_with_an_api_key(tiny_engine, tmp_path: Path) -> None:
    from art_backend.server import create_app
    from art_backend.training.service import TrainingService
    from art_integrations import RemoteBackend
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
