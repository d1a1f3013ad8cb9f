"""Rollouts with a LoRA adapter on the vLLM engine on CPU: vLLM's own LoRA ops against ours.

vLLM on CPU applies an adapter with PyTorch-native ops that copy each token's adapter matrix
before contracting it (`backend/art_backend/engine/vllm_cpu_lora.py`); the engine puts in ops
that take one matmul per adapter present. For each concurrency N, N distinct chat prompts each
get exactly `--new-tokens` new tokens (temperature 1, EOS ignored), as a group's rollouts do;
printed is the wall time of the base model, the adapter on vLLM's ops and the adapter on ours,
run side by side on one `VLLMEngine` (the ops are swapped between rounds in its worker), so a
shared machine's drift hits all three alike. Printed are medians of `--repeats` times and of the
per-repeat ratios. The adapter is peft's, rank `--rank` on every projection, with random B.

Run from the repository root, in the vLLM venv (`make setup-vllm`):
    make bench-vllm-lora ARGS="..."
    PYTHONPATH=backend:. .venv-vllm/bin/python benchmarks/bench_vllm_lora_cpu.py [--concurrency 1,32] \
        [--new-tokens 12] [--repeats 3] [--rank 8] [--model DIR]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from art_backend.engine.vllm_engine import VLLMEngine
from bench_lora_serving import ADAPTER, lora_bench_arguments, one_request, save_random_adapter
from bench_serving import render_prompts


async def seconds(engine: VLLMEngine, prompts: list[list[int]], model: str | None, new_tokens: int) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(one_request(engine, prompt, model, new_tokens) for prompt in prompts))
    return time.perf_counter() - started


async def use_grouped_ops(engine: VLLMEngine, grouped: bool) -> None:
    llm = engine._llm  # the benchmark swaps the ops the engine put in
    if not all(await engine._on_engine_loop(llm.collective_rpc("group_cpu_lora_ops", args=(grouped,)))):
        raise SystemExit("vLLM is not on CPU here, or its CPU LoRA ops are not the ones vllm_cpu_lora.py knows")


async def bench(engine: VLLMEngine, levels: list[int], new_tokens: int, repeats: int) -> list[dict[str, float]]:
    rows = []
    for n in levels:
        prompts = [engine.tokenizer.encode(p, add_special_tokens=False) for p in render_prompts(engine.tokenizer, n)]
        await seconds(engine, prompts, ADAPTER, new_tokens)  # warm-up: vLLM's first batches of a shape are slow
        times: dict[str, list[float]] = {"base": [], "vllm_ops": [], "grouped_ops": []}
        for r in range(repeats):
            times["base"].append(await seconds(engine, prompts, None, new_tokens))
            await use_grouped_ops(engine, False)
            times["vllm_ops"].append(await seconds(engine, prompts, ADAPTER, new_tokens))
            await use_grouped_ops(engine, True)
            times["grouped_ops"].append(await seconds(engine, prompts, ADAPTER, new_tokens))
            print(f"  N={n:<3} repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
        rows.append({"concurrency": n, **{k: statistics.median(v) for k, v in times.items()},
                     "speedup": statistics.median(v / g for v, g in zip(times["vllm_ops"], times["grouped_ops"])),
                     "over_base": statistics.median(g / b for g, b in zip(times["grouped_ops"], times["base"]))})
    return rows


def main() -> None:
    args, levels, model_dir = lora_bench_arguments(__doc__.splitlines()[0], "1,32", 12)
    started = time.perf_counter()
    engine = VLLMEngine(model_dir)
    with tempfile.TemporaryDirectory() as scratch:
        save_random_adapter(model_dir, args.rank, Path(scratch))
        asyncio.run(engine.load_adapter(ADAPTER, Path(scratch)))
    rows = asyncio.run(bench(engine, levels, args.new_tokens, args.repeats))
    asyncio.run(engine.close())

    print("\nconcurrency | base s | adapter, vLLM's ops s | adapter, grouped ops s | vLLM's / grouped | grouped / base")
    for row in rows:
        print(f"{row['concurrency']:>11} | {row['base']:>6.2f} | {row['vllm_ops']:>21.2f} | "
              f"{row['grouped_ops']:>22.2f} | "
              f"{row['speedup']:>15.2f}x | {row['over_base']:>13.2f}x")
    top = rows[-1]
    print(f"Medians of {args.repeats} repeat(s) (ratios: medians of each repeat's ratio); wall time of N requests.")
    print(f"Summary: at {top['concurrency']} concurrent the grouped ops take {top['grouped_ops']:.2f} s where vLLM's "
          f"take {top['vllm_ops']:.2f} s ({top['speedup']:.2f}x), {top['over_base']:.2f}x the base model's time; "
          f"took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
