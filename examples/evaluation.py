"""`python -m examples.<name>.evaluate`: score served models on an example's held-out scenarios
and print a table (the base model and a trained one on the local backend, or any
OpenAI-compatible endpoint)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence

from art_integrations import TrainableModel
from examples.runner import Example, Policy, checked_waits, common_arguments, mean_metric, open_backend, score_scenarios


async def print_scores(example: Example, policies: Sequence[Policy], held_out: int) -> None:
    scenarios = example.scenarios("val", held_out, 0)
    columns = ["held-out score", *example.metrics]
    print(f"{'model':<36} " + " ".join(f"{c:>14}" for c in columns))
    for policy in policies:
        trajectories = await score_scenarios(example, policy, scenarios)
        values = [statistics.fmean(t.reward for t in trajectories),
                  *(mean_metric(trajectories, m) for m in example.metrics)]
        print(f"{policy.model:<36} " + " ".join(f"{v:>14.3f}" for v in values), flush=True)


async def evaluate(example: Example, args: argparse.Namespace) -> None:
    if args.base_url:
        policies = [Policy(args.base_url, name, args.api_key, temperature=0, max_tokens=args.max_tokens,
                           trainable=False, **args.waits) for name in args.models or []]
        await print_scores(example, policies, args.held_out)
        return
    async with open_backend(args) as backend:
        model = TrainableModel(name=args.trained or f"{example.model_prefix}-s0", project=example.project)
        await model.register(backend)
        names = args.models or [model.base_model, model.get_inference_name(await model.get_step())]
        policies = [Policy(f"{backend.base_url}/v1", name, temperature=0, max_tokens=args.max_tokens, **args.waits)
                    for name in names]
        await print_scores(example, policies, args.held_out)


def evaluate_main(example: Example, description: str | None = None) -> None:
    parser = common_arguments(example, description)
    parser.add_argument("--base-url", help="any OpenAI-compatible endpoint (…/v1); default: start the local backend")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--models", nargs="*", default=None, help="served model names to score "
                        "(default: the base model and the newest checkpoint of --trained)")
    parser.add_argument("--trained", default=None, help=f"a model trained by train (default {example.model_prefix}-s0)")
    args = parser.parse_args()
    args.waits = checked_waits(parser, args)
    asyncio.run(evaluate(example, args))
