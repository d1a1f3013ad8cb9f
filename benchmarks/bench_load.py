"""The backend under load: many concurrent long requests with a GRPO step in the middle, and the
server's memory before, at its peak and after.

A real `art-backend serve` subprocess (the embedded model on the torch engine unless `--model`)
gets `--requests` concurrent chat requests of exactly `--new-tokens` new tokens each (EOS
ignored); once they are all decoding, the main job's stored step (`tests/fixtures/
city_facts_step.jsonl`, 12 trajectories captured from `make run`) trains a model registered on
the same backend, so the step runs while the requests are in flight (the torch engine pauses
decoding for it). The server's resident memory is read from /proc every 0.2 s throughout.

Printed: the server's resident memory idle before, its peak under load, and after (all requests
done, the step saved): 5 s later, when the finished turns' KV is still kept for a next turn, and
once the engine has dropped it (`prefix_cache_idle_seconds`, 30 s by default, plus 5 s); the
after/before ratio against the 10% the backend should return to, the requests' aggregate
tokens/s and the step's seconds; and the KV cache those requests need in the engine's precision,
the part of the peak that grows with `--requests`.

Run from the repository root:
    PYTHONPATH=backend:. python benchmarks/bench_load.py [--requests 64] [--new-tokens 512] [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import tempfile
import time
from pathlib import Path

from art_backend.config import BackendSettings
from art_backend.model_store import resolve_model_dir
from openai import AsyncOpenAI
from process_memory import reset_peak, resident_mib
from transformers import AutoConfig

from art_integrations import LocalBackend, TrainableModel, TrajectoryGroup
from art_integrations.training import TrainConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "city_facts_step.jsonl"
RETURNED_SHARE = 0.10  # after the load, the server should hold at most this much more than before


async def one_request(client: AsyncOpenAI, model: str, index: int, new_tokens: int) -> int:
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Write a long story about topic {index}."}],
        temperature=1.0, max_tokens=new_tokens, extra_body={"ignore_eos": True})
    generated = response.usage.completion_tokens if response.usage else 0
    if generated != new_tokens:
        raise RuntimeError(f"request {index}: expected {new_tokens} new tokens, got {generated}")
    return generated


async def sample_memory(pid: int, samples: list[tuple[float, float]], stop: asyncio.Event) -> None:
    started = time.perf_counter()
    while not stop.is_set():
        samples.append((time.perf_counter() - started, resident_mib(pid)[0]))
        await asyncio.sleep(0.2)


async def bench(args: argparse.Namespace) -> None:
    log = tempfile.NamedTemporaryFile(prefix="bench-load-", suffix=".log", delete=False)  # noqa: SIM115 - kept for reading
    settings = BackendSettings()  # as the server reads them, from the environment
    idle_seconds = settings.prefix_cache_idle_seconds
    if not math.isfinite(idle_seconds):
        sys.exit("ART_BACKEND_PREFIX_CACHE_IDLE_SECONDS is inf: the server would never drop its kept prefixes, "
                 "so there is no 'after' to measure; unset it or give a number of seconds.")
    model_dir = resolve_model_dir(args.model, settings.cache_dir)
    backend = LocalBackend(in_process=False, model=str(model_dir), engine="torch", art_dir=tempfile.mkdtemp(),
                           log_file=log.name)
    print(f"server pid {backend.pid} on {backend.base_url}, log {log.name}", flush=True)
    try:
        model = TrainableModel(name="load", project="bench-load")
        await model.register(backend)
        groups = [TrajectoryGroup.model_validate_json(line) for line in FIXTURE.read_text().splitlines()]
        client = AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused", max_retries=0, timeout=3600.0)
        served = (await client.models.list()).data[0].id
        await one_request(client, served, -1, 8)  # warm-up
        await asyncio.sleep(2)
        before, _ = resident_mib(backend.pid)
        reset_peak(backend.pid)
        samples: list[tuple[float, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_memory(backend.pid, samples, stop))
        started = time.perf_counter()
        requests = [asyncio.create_task(one_request(client, served, i, args.new_tokens)) for i in range(args.requests)]
        await asyncio.sleep(args.train_after)
        print(f"{args.requests} requests in flight; training a step of {sum(len(g.trajectories) for g in groups)} "
              "trajectories", flush=True)
        step_started = time.perf_counter()
        result = await model.train(groups, TrainConfig(learning_rate=1e-5))
        step_seconds = time.perf_counter() - step_started
        print(f"step {result.step} trained in {step_seconds:.1f} s; waiting for the requests", flush=True)
        tokens = sum(await asyncio.gather(*requests))
        load_seconds = time.perf_counter() - started
        await asyncio.sleep(5)
        kept, _ = resident_mib(backend.pid)
        await asyncio.sleep(idle_seconds)
        stop.set()
        await sampler
        after, peak = resident_mib(backend.pid)
        await client.close()
    finally:
        backend.stop()
    kv_mib = kv_cache_mib(model_dir, args.requests, args.new_tokens)
    print(f"\n{args.requests} concurrent requests x {args.new_tokens} new tokens, one GRPO step among them "
          f"(server resident memory, MiB)")
    rows = [("idle before", f"{before:.0f}"), ("peak under load", f"{peak:.0f}"),
            ("after, 5 s idle (turns' KV kept)", f"{kept:.0f} ({kept / before:.2f}x before)"),
            (f"after, {idle_seconds + 5:.0f} s idle (dropped)", f"{after:.0f}"),
            ("after / before", f"{after / before:.2f} (target <= {1 + RETURNED_SHARE:.2f})"),
            ("KV cache the requests need", f"{kv_mib:.0f}"),
            ("tokens/s, all requests", f"{tokens / load_seconds:.1f}"), ("the step, seconds", f"{step_seconds:.1f}")]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    timeline = ", ".join(f"{t:.0f}s {m:.0f}" for t, m in samples[:: max(1, len(samples) // 12)])
    print(f"  resident over time: {timeline}")


def kv_cache_mib(model_dir: Path, requests: int, new_tokens: int) -> float:
    """Keys and values in float32 for every request's tokens (its ~30-token prompt and its new ones)."""
    config = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return requests * (30 + new_tokens) * per_token / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--train-after", type=float, default=10.0,
                        help="seconds after the requests start that the step is sent")
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
