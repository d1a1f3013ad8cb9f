"""Serving a LoRA adapter on CPU: the embedded engine with the adapter merged, unmerged, and none.

Rollouts of a training run all use the newest checkpoint, which the engine serves with merged
weights (W + B A, packed like the base weights) unless the base weights are exact integer groups
(the embedded model), where unmerged is faster; other adapters, and batches that mix adapters,
are applied unmerged (two small matmuls per fused projection). For each concurrency N, N
distinct chat prompts each get exactly `--new-tokens` new tokens (temperature 1); printed is the
aggregate generated tokens/s of the base model, the adapter merged, and the same adapter
unmerged. Each repeat runs the three side by side on one engine (no HTTP), so a shared
machine's drift hits all three alike; printed are medians of rates and of per-repeat ratios.
The adapter is peft's, rank `--rank` on every projection, with random B (peft starts it at zero).

Run from the repository root:
    PYTHONPATH=backend:. ART_BACKEND_CACHE_DIR=/tmp/artcache python benchmarks/bench_lora_serving.py \
        [--concurrency 1,16] [--new-tokens 128] [--repeats 3] [--rank 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from art_backend.config import BackendSettings
from art_backend.engine.base import Engine, GenerationRequest, SamplingParams
from art_backend.engine.llama import LORA_TARGETS
from art_backend.engine.torch_engine import TorchEngine
from art_backend.model_store import resolve_model_dir
from bench_serving import render_prompts
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ADAPTER = "bench-adapter"
T = TypeVar("T")


def save_random_adapter(model_dir: Path, rank: int, path: Path) -> None:
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    peft_model.save_pretrained(path)


def on_a_passing_thread(job: Callable[..., T], *args: Any) -> T:
    """`job(*args)` on a thread that then ends, taking its OpenMP team with it: a second team left
    alive beside the engine's would slow every decode step (see TorchEngine.__init__)."""
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(job, *args).result()


async def one_request(engine: Engine, prompt: list[int], model: str | None, new_tokens: int) -> int:
    generated = 0
    request = GenerationRequest(prompt, SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True),
                                model=model)
    async for delta in engine.generate(request):
        generated += len(delta.token_ids)
    if generated != new_tokens:
        raise RuntimeError(f"expected {new_tokens} generated tokens, got {generated}")
    return generated


async def tokens_per_second(engine: TorchEngine, prompts: list[list[int]], model: str | None, new_tokens: int) -> float:
    started = time.perf_counter()
    generated = sum(await asyncio.gather(*(one_request(engine, p, model, new_tokens) for p in prompts)))
    return generated / (time.perf_counter() - started)


async def bench(engine: TorchEngine, levels: list[int], new_tokens: int, repeats: int) -> list[dict[str, float]]:
    adapter = engine.resolve_adapter(ADAPTER)
    assert adapter is not None
    served = adapter.merged  # None where the engine serves it unmerged (over exact integer groups)
    merged = served if served is not None else on_a_passing_thread(engine.lean.merge, adapter)  # for the comparison
    print(f"The engine serves the adapter {'merged' if served is not None else 'unmerged'} "
          f"(base weights: {engine.lean.weights_layout()})", flush=True)
    tokenizer = engine.tokenizer
    rows = []
    for n in levels:
        prompts = [tokenizer.encode(prompt, add_special_tokens=False) for prompt in render_prompts(tokenizer, n)]
        rates: dict[str, list[float]] = {"base": [], "merged": [], "unmerged": []}
        for r in range(repeats):
            rates["base"].append(await tokens_per_second(engine, prompts, None, new_tokens))
            adapter.merged = merged
            rates["merged"].append(await tokens_per_second(engine, prompts, ADAPTER, new_tokens))
            adapter.merged = None
            rates["unmerged"].append(await tokens_per_second(engine, prompts, ADAPTER, new_tokens))
            print(f"  N={n:<3} repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()) + " tok/s",
                  flush=True)
        adapter.merged = served
        rows.append({"concurrency": n, **{k: statistics.median(v) for k, v in rates.items()},
                     "merged_over_unmerged": statistics.median(m / u for m, u in zip(rates["merged"], rates["unmerged"])),
                     "merged_over_base": statistics.median(m / b for m, b in zip(rates["merged"], rates["base"]))})
    return rows


def lora_bench_arguments(description: str, concurrency: str,
                         new_tokens: int) -> tuple[argparse.Namespace, list[int], Path]:
    """The command line both LoRA serving benchmarks take: its arguments, the concurrency levels and
    the model directory; prints the run's set-up."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--concurrency", default=concurrency, help="comma-separated request counts")
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    args = parser.parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    model_dir = resolve_model_dir(args.model, BackendSettings().cache_dir)
    print(f"Model {model_dir}; LoRA rank {args.rank} on {len(LORA_TARGETS)} projections; concurrency {levels}; "
          f"{args.new_tokens} new tokens; {args.repeats} repeat(s); {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.2f} (other load skews these timings)", flush=True)
    return args, levels, model_dir


def main() -> None:
    args, levels, model_dir = lora_bench_arguments(__doc__.splitlines()[0], "1,16", 128)
    started = time.perf_counter()
    engine = TorchEngine(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        on_a_passing_thread(save_random_adapter, model_dir, args.rank, Path(scratch))
        loading = time.perf_counter()
        asyncio.run(engine.load_adapter(ADAPTER, Path(scratch)))
        load_seconds = time.perf_counter() - loading
    rows = asyncio.run(bench(engine, levels, args.new_tokens, args.repeats))
    asyncio.run(engine.close())

    print("\nconcurrency | base tok/s | adapter merged tok/s | adapter unmerged tok/s | merged / unmerged | merged / base")
    for row in rows:
        print(f"{row['concurrency']:>11} | {row['base']:>10.1f} | {row['merged']:>20.1f} | {row['unmerged']:>22.1f} | "
              f"{row['merged_over_unmerged']:>16.2f}x | {row['merged_over_base']:>12.2f}x")
    print(f"Medians of {args.repeats} repeat(s) (ratios: medians of each repeat's ratio); {args.new_tokens} new tokens "
          f"per request; aggregate generated tokens/s.")
    top = rows[-1]
    print(f"Summary: at {top['concurrency']} concurrent the merged adapter serves {top['merged_over_unmerged']:.2f}x "
          f"the unmerged one and {top['merged_over_base']:.2f}x the base model; loading the adapter took "
          f"{load_seconds:.2f} s; took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
