"""The main job: train the city-facts LangGraph agent on the embedded model and show it improve.

    python -m examples.city_facts.train            # or: make run

It scores the base model on held-out scenarios (cities never seen in training), runs GRPO
steps (rollouts grouped per scenario, partial-credit rewards), scores the trained policy on
the same held-out scenarios, and writes a learning curve. Interrupt it and run it again: it
resumes from the last checkpoint. `--model DIR` trains a bigger local model instead.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch

from art_integrations import (
    LocalBackend,
    TrainableModel,
    TrainConfig,
    TrajectoryGroup,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.langchain import ChatART
from examples.city_facts.agent import build_agent
from examples.city_facts.rollout import evaluate, rollout
from examples.city_facts.task import scenarios


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--scenarios-per-step", type=int, default=3)
    parser.add_argument("--rollouts", type=int, default=4, help="rollouts per scenario (one group)")
    parser.add_argument("--held-out", type=int, default=12, help="held-out scenarios scored before and after")
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a local Hugging Face model dir (default: embedded SmolLM2)")
    parser.add_argument("--name", default=None, help="model name (default: city-agent-s<seed>)")
    parser.add_argument("--art-dir", default=".art")
    return parser.parse_args()


async def held_out_score(model: TrainableModel, step: int, held_out: list, label: str) -> float:
    """The held-out score at `step`, from the history if this run already measured it."""
    for record in await model.history():
        if record["split"] == "val" and record["step"] == step:
            print(f"{label} held-out score (step {step}, from history): {record['reward/mean']:.3f}")
            return record["reward/mean"]
    agent = build_agent(ChatART.from_model(model, step=step, temperature=0, max_tokens=64))
    score, trajectories = await evaluate(agent, held_out)
    await model.log([TrajectoryGroup(trajectories=trajectories)], split="val")
    print(f"{label} held-out score (step {step}): {score:.3f}")
    return score


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["reward/mean"]) for r in history if r["split"] == "train"]
    val = [(r["step"], r["reward/mean"]) for r in history if r["split"] == "val"]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    if train:
        axis.plot(*zip(*train), marker=".", label="train reward (rollouts)")
    if val:
        axis.plot(*zip(*val), marker="o", linestyle="--", label="held-out score")
    axis.set_xlabel("step")
    axis.set_ylabel("reward")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title("city-facts agent, GRPO")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


async def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    held_out = scenarios("val", args.held_out)
    train = scenarios("train", args.steps * args.scenarios_per_step, seed=args.seed)
    async with LocalBackend(model=args.model, art_dir=args.art_dir) as backend:
        model = TrainableModel(name=args.name or f"city-agent-s{args.seed}", project="city-facts")
        await model.register(backend)
        base = await held_out_score(model, 0, held_out, "base model")
        agent = build_agent(ChatART.from_model(model, temperature=1.0, max_tokens=64))
        for step in range(await model.get_step(), args.steps):
            batch = train[step * args.scenarios_per_step:(step + 1) * args.scenarios_per_step]
            groups = await gather_trajectory_groups(
                [trajectory_group(lambda s=s: rollout(agent, s), n=args.rollouts, scenario=s.id) for s in batch],
                max_exceptions=0.1, progress=False)
            result = await model.train(groups, TrainConfig(learning_rate=args.learning_rate))
            m = result.metrics
            print(f"step {result.step}/{args.steps}: reward mean {m['reward/mean']:.3f} std {m['reward/std']:.3f}, "
                  f"right tool {m.get('metrics/right_tool', 0):.2f}, plain answer {m.get('metrics/plain', 0):.2f}, "
                  f"{m.get('seconds', 0):.0f} s train, groups trained {m['groups/trained']}/{len(groups)}")
        final_step = await model.get_step()
        trained = await held_out_score(model, final_step, held_out, "trained policy")
        directory = Path(args.art_dir) / model.project / "models" / model.name
        plot(await model.history(), directory / "learning_curve.png")
    print(f"\nheld-out score: base {base:.3f} -> trained {trained:.3f} ({trained - base:+.3f}) "
          f"in {(time.perf_counter() - started) / 60:.1f} min")
    print(f"checkpoints: {directory / 'checkpoints'}")
    print(f"metrics:     {directory / 'history.jsonl'}")
    print(f"plot:        {directory / 'learning_curve.png'}")


if __name__ == "__main__":
    asyncio.run(main())
