"""Per-call time of OpenPipe ART's LangGraph wrapper, for bench_capture.py to compare against.

Runs in a separate virtual environment that has `openpipe-art` (it brings ~50 packages we do
not want in ours), against a server bench_capture.py started; prints JSON with per-call seconds:
  plain  `await ChatOpenAI.ainvoke(PROMPT)` in this environment (the baseline)
  art    the same call through `art.langgraph`: `wrap_rollout(model, rollout)` around one
         `init_chat_model().ainvoke(PROMPT)` (ART logs each call to files and rebuilds the
         trajectory from them when the rollout ends; it keeps no token ids)
ART's `init_chat_model` ignores sampling arguments (temperature 1.0, no max_tokens), so the
wrapper's inner model is replaced by one with bench_capture's settings: the logging path timed
is ART's own.

    /path/to/art-venv/bin/python benchmarks/art_langgraph_calls.py URL MODEL CALLS
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

from art.langgraph import init_chat_model, wrap_rollout
from art.trajectories import Trajectory
from langchain_core.messages import HumanMessage
from langchain_openai import ChatOpenAI

PROMPT = [HumanMessage("Say hello.")]  # ART rebuilds conversations from message lists, not strings


async def main(base_url: str, model: str, calls: int) -> None:
    os.chdir(tempfile.mkdtemp())  # ART writes its logs under ./.art/langgraph
    settings = {"model": model, "base_url": base_url, "api_key": "unused", "max_tokens": 4, "temperature": 0}
    plain = ChatOpenAI(**settings)
    served = SimpleNamespace(inference_base_url=base_url, inference_api_key="unused", inference_model_name=model)

    async def rollout() -> Trajectory:
        llm = init_chat_model()
        llm.llm = ChatOpenAI(**settings)
        await llm.ainvoke(PROMPT)
        return Trajectory(messages_and_choices=[], reward=0.0)

    wrapped = wrap_rollout(served, rollout)

    async def art_call() -> None:
        trajectory = await wrapped()
        if len(trajectory.messages_and_choices) < 2:  # the prompt and the reply, rebuilt from ART's logs
            raise RuntimeError(f"ART did not record the call: {trajectory}")

    async def timed(call: Callable[[], Awaitable[object]]) -> float:
        start = time.perf_counter()
        await call()
        return time.perf_counter() - start

    for _ in range(3):  # warm-up
        await plain.ainvoke(PROMPT)
        await art_call()
    results: dict[str, list[float]] = {"plain": [], "art": []}
    for _ in range(calls):
        results["plain"].append(await timed(lambda: plain.ainvoke(PROMPT)))
        results["art"].append(await timed(art_call))
    print(json.dumps(results))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
