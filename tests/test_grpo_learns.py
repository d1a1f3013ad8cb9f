"""Proof that training learns: two GRPO steps of the real embedded model raise the reward on
held-out prompts. Task: name something of a category in exactly one word; partial credit
shrinks with every extra word, so the base model's rollouts score differently within a group.

Two steps, because the claim holds there with twice the gain it asserts on every engine: held-out 0.326 ->
0.568 after one step, 0.737 after two, 0.810 after three, 0.911 after four, the same on the torch
engine with and without the fused kernels and on vLLM (2026-12-06, AVX-512 Xeon; the rollouts are
seeded); each step more cost 8-16 s of a run alone, three times over in `make test`."""

from __future__ import annotations

import asyncio
import re
import statistics
from pathlib import Path

import pytest

from art_backend.config import BackendSettings
from art_integrations import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from benchmarks.process_memory import resident_mib
from tests.conftest import ENGINES

TRAIN_CATEGORIES = ["color", "fruit", "animal", "country", "vegetable", "musical instrument", "sport", "planet"]
HELD_OUT_CATEGORIES = ["flower", "metal", "city", "tree", "bird", "drink"]
ROLLOUTS_PER_GROUP = 8
TRAIN_STEPS = 2
# A ceiling on the torch engine's backend process's peak resident memory over the model's weight bytes
# (float32 safetensors, 538 MB), so that a regression shows. Measured here, 2026-12-03 (AVX-512 Xeon): 4.85x
# with the fused CPU kernels (integer-group serving weights), 6.4x without them (float32 serving copies).
PEAK_OVER_WEIGHTS = {True: 5.5, False: 7.2}  # by BackendSettings().cpu_kernels


def one_word_reward(text: str) -> float:
    words = re.findall(r"[A-Za-z']+", text)
    return max(0.0, 1.0 - (len(words) - 1) / 8) if words else 0.0


async def rollout_groups(model: TrainableModel, categories: list[str], seed: int) -> list[TrajectoryGroup]:
    client = model.openai_client()

    async def rollout(category: str, i: int) -> Trajectory:
        messages = [{"role": "user", "content": f"Name a {category}. Answer with one word."}]
        response = await client.chat.completions.create(
            model=model.inference_name, messages=messages, max_tokens=12, temperature=1.0, seed=seed * 1000 + i,
            logprobs=True, extra_body={"return_token_ids": True})
        trajectory = Trajectory(messages_and_choices=messages, metadata={"category": category})
        trajectory.add_response(response)
        trajectory.reward = one_word_reward(response.choices[0].message.content or "")
        return trajectory

    async def group(category: str) -> TrajectoryGroup:
        return TrajectoryGroup(trajectories=await asyncio.gather(
            *(rollout(category, i) for i in range(ROLLOUTS_PER_GROUP))))

    return list(await asyncio.gather(*(group(c) for c in categories)))


def mean_reward(groups: list[TrajectoryGroup]) -> float:
    return statistics.fmean(t.reward for g in groups for t in g.trajectories)


@pytest.mark.parametrize("engine", ENGINES)
async def test_grpo_raises_held_out_reward_of_the_embedded_model(tmp_path: Path, engine: str,
                                                                 embedded_model_dir: Path) -> None:
    if engine == "vllm":
        pytest.importorskip("vllm")
    async with LocalBackend(engine=engine, art_dir=tmp_path) as backend:
        model = TrainableModel(name="one-word", project="proof")
        await model.register(backend)
        before = mean_reward(await rollout_groups(model, HELD_OUT_CATEGORIES, seed=99))
        for step in range(TRAIN_STEPS):
            categories = TRAIN_CATEGORIES[:4] if step % 2 == 0 else TRAIN_CATEGORIES[4:]
            result = await model.train(await rollout_groups(model, categories, seed=step),
                                       TrainConfig(learning_rate=2e-4))
            assert result.step == step + 1
        after = mean_reward(await rollout_groups(model, HELD_OUT_CATEGORIES, seed=99))
        if engine == "torch":  # (vLLM's engine runs in a process of its own, apart from the backend's)
            assert backend.pid is not None  # LocalBackend's default: the backend in a process of its own
            peak = resident_mib(backend.pid)[1] * 2**20
    print(f"held-out one-word reward ({engine} engine): base {before:.3f} -> trained {after:.3f}")
    assert after >= before + 0.2, (before, after)
    if engine == "torch":
        weights = sum(path.stat().st_size for path in embedded_model_dir.glob("*.safetensors"))
        ceiling = PEAK_OVER_WEIGHTS[BackendSettings().cpu_kernels]
        print(f"backend peak: {peak / 2**30:.2f} GiB, {peak / weights:.2f}x the weights (ceiling {ceiling}x)")
        assert peak <= ceiling * weights, (peak, weights)
