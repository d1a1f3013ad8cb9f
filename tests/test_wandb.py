"""W&B logging with WANDB_MODE=offline: a training job run twice (a restart, in fresh processes)
logs every train and val record of history.jsonl into one run, read back from the offline run
files; a W&B that fails does not stop training; a missing SDK is explained."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from wandb.proto import wandb_internal_pb2

from art_integrations import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_integrations.observability.wandb import numeric_metrics, run_id, wandb_wanted
from tests.conftest import checkout_env, tiny_backend


# One step of a training job, as a user writes it: validate, then train. Run in its own process,
# so a second run is a real restart.
JOB = """
import asyncio, json, sys
from art_integrations import RemoteBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

async def group(model):
    client = model.openai_client()
    trajectories = []
    for reward in (0.0, 1.0):
        messages = [{"role": "user", "content": "Name a color."}]
        response = await client.chat.completions.create(model=model.inference_name, messages=messages, max_tokens=6,
                                                        logprobs=True, extra_body={"return_token_ids": True})
        trajectory = Trajectory(messages_and_choices=messages, reward=reward)
        trajectory.add_response(response)
        trajectories.append(trajectory)
    return TrajectoryGroup(trajectories=trajectories)

async def main(url):
    async with RemoteBackend(url) as backend:
        model = TrainableModel(name="agent", project="wb-demo")
        await model.register(backend)
        await model.log([await group(model)], split="val")
        result = await model.train([await group(model)], TrainConfig(learning_rate=1e-3))
        print(json.dumps({"step": result.step, "errors": model.metrics_reporter.errors}))

asyncio.run(main(sys.argv[1]))
"""


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file: a 7-byte header, then 32 KiB blocks of chunks, each with a
    7-byte header (checksum, length, type: full, first, middle, last) holding a protobuf Record."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # too little room left for a header: the block is padded
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (1, 4):  # full, or the last chunk of a record
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def history_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})  # W&B's own _step, _runtime
    return rows


def run_record(path: Path) -> Any:
    return next(r.run for r in wandb_records(path) if r.WhichOneof("record_type") == "run")


@pytest.fixture(scope="module")
def art_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("art")


@pytest.fixture(scope="module")
async def backend(art_dir: Path) -> AsyncIterator[LocalBackend]:
    async with tiny_backend(art_dir) as running:
        yield running


def run_job(backend: LocalBackend, wandb_dir: Path) -> dict[str, Any]:
    env = checkout_env(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)
    done = subprocess.run([sys.executable, "-c", JOB, backend.base_url], capture_output=True, text=True, env=env,
                          timeout=300, cwd=wandb_dir, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_offline_run_gets_every_history_record_and_a_restart_resumes_it(backend: LocalBackend, art_dir: Path,
                                                                             tmp_path: Path) -> None:
    first = run_job(backend, tmp_path)
    second = run_job(backend, tmp_path)  # the job restarted: it resumes from step 1
    assert (first, second) == ({"step": 1, "errors": []}, {"step": 2, "errors": []})

    runs = sorted((tmp_path / "wandb").glob("offline-run-*-agent*/run-agent.wandb"),
                  key=lambda p: history_rows(p)[0]["training_step"])
    assert len(runs) == 2  # one file per process, both for run id "agent": `wandb sync` appends them
    for path in runs:
        run = run_record(path)
        assert (run.run_id, run.project, run.display_name) == ("agent", "wb-demo", "agent")
        assert run.resume  # asked to resume: synced, the second file carries on the first's run
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
              for item in run_record(runs[0]).config.update}
    assert config["base_model"] == "tiny-random-smollm2" and config["lora"]["rank"] == 8
    metrics = [r.metric for r in wandb_records(runs[0]) if r.WhichOneof("record_type") == "metric"]
    assert any(m.glob_name == "*" and m.step_metric == "training_step" for m in metrics)

    history = [json.loads(line) for line in
               (art_dir / "wb-demo" / "models" / "agent" / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["split"]) for h in history] == [(0, "val"), (1, "train"), (1, "val"), (2, "train")]
    expected = [{"training_step": h["step"],
                 **numeric_metrics(h["split"], {k: v for k, v in h.items() if k not in ("step", "split", "time")})}
                for h in history]
    assert history_rows(runs[0]) == expected[:2]
    assert history_rows(runs[1]) == expected[2:]  # after the restart: the same run, carried on
    assert expected[1]["train/reward/mean"] == 0.5 and "train/loss" in expected[1]


async def test_a_failing_wandb_is_reported_and_training_goes_on(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("WANDB_MODE", "no-such-mode")  # switches W&B on, and makes wandb.init fail
    model = TrainableModel(name="unlogged", project="wb-demo")
    await model.register(backend)
    reporter = model.metrics_reporter
    assert reporter is not None and reporter.run_id == "unlogged"
    client = model.openai_client()
    trajectories = []
    for reward in (0.0, 1.0):
        messages = [{"role": "user", "content": "Hi"}]
        response = await client.chat.completions.create(model=model.inference_name, messages=messages, max_tokens=4,
                                                        extra_body={"return_token_ids": True})
        trajectory = Trajectory(messages_and_choices=messages, reward=reward)
        trajectory.add_response(response)
        trajectories.append(trajectory)
    with caplog.at_level(logging.WARNING, logger="art_integrations.observability.wandb"):
        result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-3))
        await model.log([TrajectoryGroup(trajectories=trajectories)], split="val")
    assert result.step == 1 and result.metrics["trained"] is True
    (error,) = reporter.errors  # logged once; not retried every step
    assert "W&B logging is off for wb-demo/unlogged: wandb.init failed" in error and "no-such-mode" in error
    assert [r.getMessage() for r in caplog.records] == [error]


async def test_switching_on_and_a_missing_sdk(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert not wandb_wanted(None) and wandb_wanted(["wandb"]) and not wandb_wanted([])
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not wandb_wanted(None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_wanted(None) and not wandb_wanted([])
    assert run_id("p", "agent-1.b") == "agent-1.b" and run_id("p", "a/b:c").startswith("a-b-c-")
    assert run_id("p", "a/b") != run_id("q", "a/b")

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "art-integrations\[wandb\]"'):
        await TrainableModel(name="asked", project="wb-demo", report_metrics=["wandb"]).register(backend)
    with caplog.at_level(logging.WARNING, logger="art_integrations.observability.wandb"):
        model = TrainableModel(name="environment", project="wb-demo")  # switched on only by WANDB_MODE
        await model.register(backend)
    assert model.metrics_reporter is None
    assert "WANDB_API_KEY or WANDB_MODE is set, but metrics are not logged to W&B" in caplog.text
    with pytest.raises(ValueError, match="wandb"):
        TrainableModel(name="typo", project="wb-demo", report_metrics=["wandbb"])
