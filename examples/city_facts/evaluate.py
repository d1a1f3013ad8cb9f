"""Score served models on the city-facts held-out scenarios and print a table.

    python -m examples.city_facts.evaluate                               # base vs trained, local backend
    python -m examples.city_facts.evaluate --trained city-agent-s0       # a model trained by train.py
    python -m examples.city_facts.evaluate --base-url URL --models a b   # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. The agent runs greedily, as in train.py's held-out score.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from langchain_openai import ChatOpenAI

from art_integrations import LocalBackend, TrainableModel
from examples.city_facts.agent import build_agent
from examples.city_facts.rollout import evaluate
from examples.city_facts.task import scenarios


async def score_models(base_url: str, api_key: str, models: list[str], held_out: int) -> None:
    cases = scenarios("val", held_out)
    print(f"{'model':<36} {'held-out score':>14} {'right tool':>10} {'states fact':>11}")
    for name in models:
        llm = ChatOpenAI(model=name, base_url=base_url, api_key=api_key, temperature=0, max_tokens=64)
        score, trajectories = await evaluate(build_agent(llm), cases)

        def rate(metric: str) -> float:
            return statistics.fmean(float(t.metrics.get(metric, 0)) for t in trajectories)

        print(f"{name:<36} {score:>14.3f} {rate('right_tool'):>10.2f} {rate('states_fact'):>11.2f}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="an OpenAI-compatible endpoint (…/v1); default: start the local backend")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--models", nargs="*", default=None, help="served model names to score")
    parser.add_argument("--trained", default="city-agent-s0", help="with the local backend: a model trained by train.py")
    parser.add_argument("--art-dir", default=".art")
    parser.add_argument("--model", default=None, help="the local backend's base model dir (default: embedded)")
    parser.add_argument("--held-out", type=int, default=12)
    args = parser.parse_args()
    if args.base_url:
        await score_models(args.base_url, args.api_key, args.models or [], args.held_out)
        return
    async with LocalBackend(model=args.model, art_dir=args.art_dir) as backend:
        model = TrainableModel(name=args.trained, project="city-facts")
        await model.register(backend)
        names = args.models or [model.base_model, model.get_inference_name(await model.get_step())]
        await score_models(f"{backend.base_url}/v1", "unused", names, args.held_out)


if __name__ == "__main__":
    asyncio.run(main())
