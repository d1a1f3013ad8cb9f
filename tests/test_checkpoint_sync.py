"""Checkpoint sync to object storage: against a real S3 server on loopback (moto's server mode)
and file:// URLs, with real training steps on the tiny model. A pull into an empty art dir resumes
training at the pulled step; a push killed before its manifest leaves the store as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import boto3
import pytest

from art_integrations import BackendError, LocalBackend, TrainableModel, TrainConfig
from tests.conftest import scored_group, tiny_backend

BUCKET = "art-runs"  # created by the first push, as ART's push does


def _keys(endpoint: str, prefix: str) -> set[str]:
    client = boto3.client("s3", endpoint_url=endpoint)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {item["Key"].removeprefix(prefix) for page in pages for item in page.get("Contents", [])}


async def _train_step(model: TrainableModel, scenario: str) -> int:
    result = await model.train([await scored_group(model, scenario, [0.0, 1.0, 0.5])],
                               TrainConfig(learning_rate=1e-3))
    return result.step


async def test_a_pull_into_an_empty_art_dir_resumes_training_at_the_pulled_step(tmp_path: Path, s3: str) -> None:
    where = "exp/demo/models/agent/"
    async with tiny_backend(tmp_path / "first") as backend:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        assert await _train_step(model, "a") == 1
        await model.log([await scored_group(model, "val", [0.2, 0.4])], split="val")
        await backend._experimental_push_to_s3(model, s3_bucket=BUCKET, prefix="exp")  # creates the bucket
    stored = _keys(s3, where)
    assert {"manifest.json", "model.json", "history.jsonl", "checkpoints/0001/adapter_model.safetensors",
            "checkpoints/0001/optimizer.pt", "trajectories/train/0001.jsonl", "trajectories/val/0001.jsonl"} <= stored

    async with tiny_backend(tmp_path / "second") as backend:  # another machine, empty art dir
        model = TrainableModel(name="agent", project="demo")
        await backend._experimental_pull_from_s3(model, s3_bucket=BUCKET, prefix="exp")  # ART's order: pull, register
        await model.register(backend)
        assert await model.get_step() == 1
        history = await model.history()
        assert [(r["step"], r["split"]) for r in history] == [(1, "train"), (1, "val")]
        assert await _train_step(model, "b") == 2  # from the pulled adapter and optimizer state
        result = await backend.push_checkpoints(model, f"s3://{BUCKET}/exp")
        assert result["steps"] == [1, 2]
        assert all("0001" not in path for path in result["uploaded"])  # step 1 was in the store already
        assert "checkpoints/0002/adapter_model.safetensors" in result["uploaded"]
    manifest = json.loads(boto3.client("s3").get_object(Bucket=BUCKET, Key=where + "manifest.json")["Body"].read())
    assert manifest["steps"] == [1, 2]

    async with tiny_backend(tmp_path / "third") as backend:  # only the newest step
        model = TrainableModel(name="agent", project="demo")
        await backend._experimental_pull_from_s3(model, s3_bucket=BUCKET, prefix="exp", only_step="latest",
                                                 exclude=["trajectories", "logs"])
        await model.register(backend)
        assert await model.get_step() == 2
        directory = tmp_path / "third" / "demo" / "models" / "agent"
        assert [p.name for p in (directory / "checkpoints").iterdir()] == ["0002"]
        assert not (directory / "trajectories").exists()


async def test_a_push_killed_before_its_manifest_never_looks_complete(tmp_path: Path, s3: str,
                                                                      tiny_model_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    art_dir = tmp_path / "trained"
    async with tiny_backend(art_dir) as backend:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        await _train_step(model, "a")
        await backend.push_checkpoints(model, f"s3://{BUCKET}")
        await _train_step(model, "b")
    monkeypatch.setenv("ART_TEST_KILL_AT", "push_files_uploaded")  # read by the child backend only
    child = LocalBackend(in_process=False, model=str(tiny_model_dir), art_dir=art_dir)
    try:
        await model.register(child)
        with pytest.raises(BackendError, match="connection broke"):
            await child.push_checkpoints(model, f"s3://{BUCKET}")
    finally:
        await child.close()
    assert "checkpoints/0002/adapter_model.safetensors" in _keys(s3, "demo/models/agent/")  # uploaded, not listed
    monkeypatch.delenv("ART_TEST_KILL_AT")

    async with tiny_backend(tmp_path / "restored") as backend:
        model = TrainableModel(name="agent", project="demo")
        result = await backend.pull_checkpoints(model, f"s3://{BUCKET}")
        assert result["pulled"] == [1]  # step 2 never had its manifest
        await model.register(backend)
        assert await model.get_step() == 1


async def test_any_fsspec_url_serves_pulled_steps_and_refuses_damage(tmp_path: Path) -> None:
    store = f"file://{tmp_path / 'store'}"
    async with tiny_backend(tmp_path / "first") as backend:
        model = TrainableModel(name="agent", project="demo")
        nothing = await backend.pull_checkpoints(model, store)  # a first run pulls before anything was pushed
        assert nothing["pulled"] == [] and "nothing at" in nothing["note"]
        await model.register(backend)
        await _train_step(model, "a")
        assert (await backend.push_checkpoints(model, store))["steps"] == [1]

    async with tiny_backend(tmp_path / "second") as backend:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)  # registered first: the pulled step is served at once
        assert (await backend.pull_checkpoints(model, store, step=1))["pulled"] == [1]
        assert await model.get_step() == 1
        answer = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(1), messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert answer.choices[0].message is not None
        with pytest.raises(BackendError, match="Step 7 is not in the store"):
            await backend.pull_checkpoints(model, store, step=7)
        with pytest.raises(BackendError, match="'runs/store' is not a storage URL"):  # not the backend's cwd
            await backend.push_checkpoints(model, "runs/store")
        with pytest.raises(BackendError, match="names an absolute path"):
            await backend.push_checkpoints(model, "file://runs/store")
        with pytest.raises(ValueError, match="never deletes"):
            await backend._experimental_pull_from_s3(model, s3_bucket="b", delete=True)

        damaged = tmp_path / "store" / "demo" / "models" / "agent" / "checkpoints" / "0001" / "optimizer.pt"
        damaged.write_bytes(b"not the pushed bytes")
        other = TrainableModel(name="agent", project="demo")
    async with tiny_backend(tmp_path / "third") as backend:
        with pytest.raises(BackendError, match="optimizer.pt does not match the manifest"):
            await backend.pull_checkpoints(other, store)
        await other.register(backend)
        assert await other.get_step() == 0  # nothing half-pulled is taken for a step


async def test_a_backend_with_a_checkpoint_store_pushes_each_step_before_answering_and_resumes_from_it(
        tmp_path: Path, s3: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the backend's checkpoint_store setting (what RayBackend gives its actor): a node that may vanish
    monkeypatch.setenv("ART_BACKEND_CHECKPOINT_STORE", f"s3://{BUCKET}/mirror")
    where = "mirror/demo/models/agent/"
    async with tiny_backend(tmp_path / "first") as backend:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        assert await _train_step(model, "a") == 1
        assert "checkpoints/0001/adapter_model.safetensors" in _keys(s3, where)  # there once acknowledged
        await model.log([await scored_group(model, "val", [0.2, 0.4])], split="val")
        assert "trajectories/val/0001.jsonl" in _keys(s3, where)
    async with tiny_backend(tmp_path / "second") as backend:  # a fresh node: registering pulls what it lacks
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        assert await model.get_step() == 1
        assert [(r["step"], r["split"]) for r in await model.history()] == [(1, "train"), (1, "val")]
        assert await _train_step(model, "b") == 2
        await model.log([await scored_group(model, "val", [0.9, 1.0])], split="val")  # the best: step 1 goes
        deleted = await model.delete_checkpoints()  # deletions reach the store too, or a restart would pull them back
    assert deleted == {"deleted": [1], "kept": [2]}
    stored = _keys(s3, where)
    assert "checkpoints/0002/optimizer.pt" in stored and not any(k.startswith("checkpoints/0001/") for k in stored)

    # a store that does not answer: a model is not registered from a store it cannot read
    monkeypatch.setenv("ART_BACKEND_CHECKPOINT_STORE_OPTIONS", '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}')
    async with tiny_backend(tmp_path / "third") as backend:
        with pytest.raises(BackendError, match=r"\(502\).*failed: .*Check the URL"):
            await TrainableModel(name="agent", project="demo").register(backend)


async def test_a_step_the_checkpoint_store_refuses_is_served_but_not_called_safe(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "store"
    monkeypatch.setenv("ART_BACKEND_CHECKPOINT_STORE", store.as_uri())
    async with tiny_backend(tmp_path / "node") as backend:
        model = TrainableModel(name="agent", project="demo")
        await model.register(backend)
        assert await _train_step(model, "a") == 1
        checkpoints = store / "demo" / "models" / "agent" / "checkpoints"
        shutil.rmtree(checkpoints)
        checkpoints.write_text("not a folder")  # every later checkpoint upload fails
        with pytest.raises(BackendError, match=r"\(502\): Step 2 of demo/agent is committed on this node but not in "
                                               r"the checkpoint store, so it would not outlive the node"):
            await _train_step(model, "b")
        assert await model.get_step() == 2  # committed and served here, as the error says
