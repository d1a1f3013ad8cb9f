"""Before training: does an example's reward give GRPO anything to learn from at a temperature?

    .venv/bin/python -m examples.probe email_search [--temperatures 1.0 0.6 0] [--scenarios 8] [--rollouts 4]

Samples the base model on the first training scenarios of seed `--seed`, group by group, with the
seeds training step 0 would use (so a run repeats), and prints per temperature: the mean reward,
the mean of every metric the rollouts record, and how many groups have signal (rollouts that
differ in reward; a group whose rollouts all score alike teaches nothing). `--show` prints each
rollout's tool calls and reward. Temperature 0 is greedy, as held-out scoring is: one rollout
per scenario.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import statistics
from dataclasses import replace

from art_integrations import TrainableModel, Trajectory

from examples.runner import Example, Policy, open_backend, rollout_seed


def tool_calls(trajectory: Trajectory) -> list[str]:
    """`name(arguments)` of each tool call the model made, in order."""
    return [f"{call['function']['name']}({call['function']['arguments']})"
            for message in trajectory.messages() for call in message.get("tool_calls") or []]


async def sample(example: Example, policy: Policy, args: argparse.Namespace) -> list[list[Trajectory]]:
    """One group per scenario, all at once as in a training step; rollout r of scenario i samples
    with training step 0's seed."""
    rollouts = 1 if policy.temperature == 0 else args.rollouts
    scenarios = example.scenarios("train", args.scenarios, args.seed)
    done = await asyncio.gather(*(example.rollout(replace(policy, seed=rollout_seed(args.seed, 0, i, r)), scenario)
                                  for i, scenario in enumerate(scenarios) for r in range(rollouts)))
    return [list(done[i:i + rollouts]) for i in range(0, len(done), rollouts)]


def summary(temperature: float, groups: list[list[Trajectory]]) -> dict[str, str]:
    trajectories = [t for group in groups for t in group]
    row = {"temperature": f"{temperature:g}", "rollouts": str(len(trajectories)),
           "reward": f"{statistics.fmean(t.reward for t in trajectories):.3f}"}
    for metric in dict.fromkeys(m for t in trajectories for m in t.metrics):
        row[metric] = f"{statistics.fmean(float(t.metrics.get(metric, 0)) for t in trajectories):.3f}"
    with_signal = sum(max(t.reward for t in group) > min(t.reward for t in group) for group in groups)
    row["groups with signal"] = f"{with_signal}/{len(groups)}" if len(groups[0]) > 1 else "-"
    return row


async def probe(example: Example, args: argparse.Namespace) -> None:
    rows = []
    async with open_backend(args) as backend:
        model = TrainableModel(name=f"{example.model_prefix}-probe", project=example.project)
        await model.register(backend)
        for temperature in args.temperatures:
            policy = Policy(f"{backend.base_url}/v1", model.inference_name, temperature=temperature,
                            max_tokens=args.max_tokens)
            groups = await sample(example, policy, args)
            rows.append(summary(temperature, groups))
            print(" | ".join(f"{key} {value}" for key, value in rows[-1].items()), flush=True)
            if args.show:
                for group in groups:
                    for trajectory in group:
                        print(f"  {trajectory.reward:.3f} {json.dumps(tool_calls(trajectory))}")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print("\n| " + " | ".join(columns) + " |\n|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(row.get(column, "") for column in columns) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("example", help="a folder of examples/ with a rollout module (e.g. email_search)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=None,
                        help="default: the example's training temperature")
    parser.add_argument("--scenarios", type=int, default=8, help="training scenarios, one group each")
    parser.add_argument("--rollouts", type=int, default=None, help="per group (default: the example's)")
    parser.add_argument("--seed", type=int, default=0, help="the run seed whose scenarios and samples to draw")
    parser.add_argument("--max-tokens", type=int, default=None, help="per model call (default: the example's)")
    parser.add_argument("--model", default=None, help="a Hugging Face model dir (default: the embedded model)")
    parser.add_argument("--engine", default=None, choices=["auto", "torch", "vllm"])
    parser.add_argument("--art-dir", default=".art")
    parser.add_argument("--show", action="store_true", help="print every rollout's tool calls and reward")
    args = parser.parse_args()
    try:
        example: Example = importlib.import_module(f"examples.{args.example}.rollout").EXAMPLE
    except ModuleNotFoundError as error:
        parser.error(f"no example {args.example!r} ({error}); pass a folder of examples/, e.g. email_search")
    if any(t < 0 for t in args.temperatures or ()):
        parser.error("--temperatures must be 0 (greedy) or more")
    for name in ("scenarios", "rollouts", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more")
    args.temperatures = args.temperatures or [example.temperature]
    args.rollouts = args.rollouts if args.rollouts is not None else example.rollouts
    args.max_tokens = args.max_tokens if args.max_tokens is not None else example.max_tokens
    args.backend_url = None
    asyncio.run(probe(example, args))


if __name__ == "__main__":
    main()
