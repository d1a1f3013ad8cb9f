"""Serving throughput on CPU: the art-backend server against plain transformers `generate`.

For each concurrency N (default 1, 8, 16), N distinct short chat prompts each get exactly
`--new-tokens` new tokens (EOS ignored); printed is the aggregate generated tokens/s of:
  backend      a real `python -m art_backend serve` subprocess on a free loopback port, sent N
               concurrent requests with `openai.AsyncOpenAI` (each choice's `token_ids` counted);
               once per `--dtype` (float32: the default, exact; bfloat16: the opt-in faster
               weights);
  per-request  transformers `model.generate` once per request, one after another;
  padded       transformers `model.generate` on all N prompts as one left-padded batch.
Sampling: temperature 1.0, top_p 1.0, no top_k. Baselines load the model in the same dtype as
the backend they are compared with. Each repeat runs the three side by side (backend round,
then padded batch, then one per-request generation; the idle server uses no CPU meanwhile), so
a shared machine's drift hits all three alike; printed are the medians of `--repeats` rates and
the medians of the per-repeat ratios. Targets at the highest concurrency: backend >= 10x
per-request and >= 2x padded batch. Beside each rate: the server process's peak resident memory
over that concurrency's rounds (its peak reset first) and its resident memory after them, in MiB.

Run from the repository root:
    PYTHONPATH=backend:. ART_BACKEND_CACHE_DIR=/tmp/artcache python benchmarks/bench_serving.py \
        [--concurrency 1,8,16] [--new-tokens 128] [--repeats 3] [--model DIR] [--json out.json] \
        [--dtype float32,bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from art_backend.config import BackendSettings
from art_backend.model_store import resolve_model_dir
from openai import AsyncOpenAI
from process_memory import reset_peak, resident_mib
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from art_integrations import LocalBackend

PER_REQUEST_GAIN_TARGET = 10.0
PADDED_GAIN_TARGET = 2.0
SAMPLING: dict[str, Any] = {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}


def chat_messages(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a short story about topic {i}."}] for i in range(count)]


async def one_request(client: AsyncOpenAI, model: str, messages: list[dict[str, str]], new_tokens: int,
                      return_token_ids: bool = True, logprobs: bool = False) -> int:
    """Exactly `new_tokens` new tokens (EOS ignored), counted from the choice's `token_ids`, or
    without `return_token_ids` from `usage.completion_tokens` (the plain OpenAI request)."""
    response = await client.chat.completions.create(
        model=model, messages=messages, temperature=1.0, max_tokens=new_tokens,  # type: ignore[arg-type]
        logprobs=logprobs, extra_body={"ignore_eos": True, **({"return_token_ids": True} if return_token_ids else {})})
    if return_token_ids:
        counts = [len((choice.model_extra or {}).get("token_ids") or []) for choice in response.choices]
    else:
        counts = [response.usage.completion_tokens if response.usage else 0]
    if counts != [new_tokens]:
        raise RuntimeError(f"expected {new_tokens} generated tokens, got {counts}")
    return counts[0]


async def served_model(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


async def concurrent_round(client: AsyncOpenAI, model: str, prompts: list[list[dict[str, str]]],
                           new_tokens: int, return_token_ids: bool = True, logprobs: bool = False) -> None:
    await asyncio.gather(*(one_request(client, model, p, new_tokens, return_token_ids, logprobs) for p in prompts))


def render_prompts(tokenizer: PreTrainedTokenizerBase, count: int) -> list[str]:
    return [tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            for messages in chat_messages(count)]


def hf_generate(model: Any, tokenizer: PreTrainedTokenizerBase, prompts: list[str], new_tokens: int) -> None:
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=tokenizer.pad_token_id, **SAMPLING)
    generated = out.shape[1] - batch["input_ids"].shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"generate produced {generated} tokens, expected {new_tokens}")


def timed(run: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    run(*args)
    return time.perf_counter() - start


def bench_side_by_side(model: str | None, model_dir: Path, levels: list[int], new_tokens: int, repeats: int,
                       dtype: str) -> list[dict[str, Any]]:
    """Per concurrency and repeat: a backend round, a padded batch, one per-request generation."""
    log = tempfile.NamedTemporaryFile(prefix="bench-serving-", suffix=".log", delete=False)  # noqa: SIM115 - the log outlives this run
    os.environ["ART_BACKEND_DTYPE"] = dtype  # read by the child's settings
    backend = LocalBackend(in_process=False, model=model or str(model_dir), art_dir=tempfile.mkdtemp(),
                           log_file=log.name)
    print(f"Server on {backend.base_url} ({dtype}), log {log.name}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf_logging.disable_progress_bar()
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    rows = []
    try:
        with asyncio.Runner() as runner:
            client = AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0, timeout=1800.0)
            served = runner.run(served_model(client))
            runner.run(concurrent_round(client, served, chat_messages(1), min(8, new_tokens)))  # warm-up
            hf_generate(hf_model, tokenizer, render_prompts(tokenizer, 1), min(8, new_tokens))  # warm-up
            for n in levels:
                messages, prompts = chat_messages(n), render_prompts(tokenizer, n)
                rates: dict[str, list[float]] = {"backend": [], "padded": [], "per_request": []}
                reset_peak(backend.pid)
                for r in range(repeats):
                    rates["backend"].append(n * new_tokens / timed(
                        runner.run, concurrent_round(client, served, messages, new_tokens)))
                    rates["padded"].append(n * new_tokens / timed(hf_generate, hf_model, tokenizer, prompts, new_tokens))
                    # one request per repeat: N sequential requests take exactly N times as long
                    rates["per_request"].append(new_tokens / timed(
                        hf_generate, hf_model, tokenizer, [prompts[r % n]], new_tokens))
                    print(f"  {dtype} N={n:<3} repeat {r + 1}: " + ", ".join(
                        f"{name} {values[-1]:.1f}" for name, values in rates.items()) + " tok/s", flush=True)
                after, peak = resident_mib(backend.pid)
                rows.append({**build_row(dtype, n, rates), "server_peak_mib": peak, "server_after_mib": after})
            runner.run(client.close())
    finally:
        backend.stop()
    return rows


def median_row(rates: dict[str, list[float]], ratios: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """`<name>_tok_s`: the median of each name's rates; per ratio (numerator, denominator): the
    median of the repeats' ratios, each repeat's rates having been taken side by side."""
    return {**{f"{name}_tok_s": statistics.median(values) for name, values in rates.items()},
            **{ratio: statistics.median(a / b for a, b in zip(rates[over], rates[under]))
               for ratio, (over, under) in ratios.items()}, "repeats": rates}


def build_row(dtype: str, n: int, rates: dict[str, list[float]]) -> dict[str, Any]:
    return {"dtype": dtype, "concurrency": n, **median_row(
        rates, {"over_per_request": ("backend", "per_request"), "over_padded": ("backend", "padded")})}


def print_aligned(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    print("\n" + " | ".join(header))
    for cells in rows:
        print(" | ".join(c.rjust(len(h)) for c, h in zip(cells, header)))


def print_table(rows: list[dict[str, Any]], new_tokens: int, repeats: int) -> None:
    header = ("dtype", "concurrency", "backend tok/s", "generate per-request tok/s", "generate padded-batch tok/s",
              "backend / per-request", "backend / padded", "server peak MiB", "server after MiB")
    print_aligned(header, [
        (row["dtype"], f"{row['concurrency']}", f"{row['backend_tok_s']:.1f}", f"{row['per_request_tok_s']:.1f}",
         f"{row['padded_tok_s']:.1f}", f"{row['over_per_request']:.2f}x", f"{row['over_padded']:.2f}x",
         f"{row['server_peak_mib']:,.0f}", f"{row['server_after_mib']:,.0f}")
        for row in rows])
    print(f"Medians of {repeats} repeat(s) (ratios: medians of each repeat's ratio); {new_tokens} new tokens per "
          "request; aggregate generated tokens/s. Each row's baselines run transformers in the backend's dtype.")
    print("Per-request: one request timed per repeat; N sequential requests give "
          f"N*{new_tokens} / (N * seconds per request), i.e. the single-request rate.")


def check_targets(row: dict[str, Any]) -> dict[str, bool]:
    prefix = f"{row['dtype']} at {row['concurrency']} concurrent: backend"
    checks = {f"{prefix} >= {PER_REQUEST_GAIN_TARGET:g}x per-request": row["over_per_request"] >= PER_REQUEST_GAIN_TARGET,
              f"{prefix} >= {PADDED_GAIN_TARGET:g}x padded batch": row["over_padded"] >= PADDED_GAIN_TARGET}
    for name, passed in checks.items():
        print(f"Target {name}: {'PASS' if passed else 'FAIL'}")
    return checks


def serving_parser(description: str) -> argparse.ArgumentParser:
    """The options every serving benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--concurrency", default="1,8,16", help="comma-separated request counts")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser


def main() -> None:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32",
                        help="comma-separated serving precisions: float32 (the default, exact), bfloat16; "
                             "transformers runs in the same dtype for that row's baselines")
    args = parser.parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    dtypes = args.dtype.split(",")
    model_dir = resolve_model_dir(args.model, BackendSettings().cache_dir)
    print(f"Model {model_dir}; concurrency {levels}; {args.new_tokens} new tokens; {args.repeats} repeat(s); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other load skews these timings)")
    started = time.perf_counter()
    rows = []
    for dtype in dtypes:
        rows += bench_side_by_side(args.model, model_dir, levels, args.new_tokens, args.repeats, dtype)
    print_table(rows, args.new_tokens, args.repeats)
    top = max(levels)
    checks = {name: passed for row in rows if row["concurrency"] == top for name, passed in check_targets(row).items()}
    verdict = "all targets met" if all(checks.values()) else "some targets missed"
    rates = ", ".join(f"{row['dtype']} {row['backend_tok_s']:.1f}" for row in rows if row["concurrency"] == top)
    print(f"Summary: {verdict}; backend tok/s at {top} concurrent: {rates}; "
          f"took {time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.2f}.")
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(model_dir), "new_tokens": args.new_tokens,
                                         "repeats": args.repeats, "rows": rows, "targets": checks}, indent=2))


if __name__ == "__main__":
    main()
