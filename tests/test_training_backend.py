"""Training through the user's API against real backends (tiny model), on each engine: checkpoints,
serving, history, resuming after a restart (the backend's life around it: test_backend_lifecycle.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from art_integrations import GatheredGroups, LocalBackend, TrainableModel, TrainConfig, TrajectoryGroup
from tests.conftest import ENGINES, scored_group

TINY = "tiny-random-smollm2"


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
