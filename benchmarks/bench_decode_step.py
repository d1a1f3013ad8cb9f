"""One decode step of a training run's rollouts on CPU: rows reading their common prompt start
from one slot against each row reading its own copy.

The main job decodes 3 groups of 4 rollouts at once; a group's rollouts share their prompt (system
prompt, tools, question: ~580 tokens) and sit at ~700 tokens of context. Every row's slot holds
its own copy of that start's keys and values (the engine copies a cached prefix into each slot),
so a decode step of float32 keys and values streams ~13 MB a layer from memory when each row
reads its own copy, a fourth of that when a group's rows read their leader's copy one after
another (`decode_attention`'s shared slots; the numbers are the same: `tests/test_engine.py`).

Measured on the embedded model with the fused kernels, a random LoRA adapter on every row (as
in training), each row's context filled by a real prefill: the forward of one decode step of
`--groups` x `--group-size` rows at `--context` tokens, `--shared` of them common within a group.
The two ways alternate, `--repeats` steps each after a warm-up; printed are medians in ms.

    .venv/bin/python benchmarks/bench_decode_step.py [--groups 3] [--group-size 4] [--context 700] \
        [--shared 580] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from art_backend.config import BackendSettings
from art_backend.engine.llama import PROJECTIONS, LeanLlama
from art_backend.model_store import embedded_model_dir
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--context", type=int, default=700)
    parser.add_argument("--shared", type=int, default=580)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not 0 < args.shared <= args.context:
        parser.error("--shared must be between 1 and --context")
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(Path(BackendSettings().cache_dir))).eval()
    lean = LeanLlama(model, max_len=args.context + 8)
    if lean.kernels is None:
        raise SystemExit("the fused CPU kernels did not build here; see the warning above")
    generator = torch.Generator().manual_seed(0)
    a, b = {}, {}
    for layer, linears in enumerate(lean._modules):
        for projection, names in PROJECTIONS.items():
            for name, module in zip(names, linears[projection]):
                a[(layer, name)] = torch.randn(8, module.in_features, generator=generator) * 0.01
                b[(layer, name)] = torch.randn(module.out_features, 8, generator=generator) * 0.01
    adapter = lean.fuse_lora(a, b)

    rows = args.groups * args.group_size
    vocab = model.config.vocab_size
    starts = torch.randint(0, vocab, (args.groups, args.shared), generator=generator)
    tails = torch.randint(0, vocab, (rows, args.context - args.shared), generator=generator)
    tokens = torch.cat([starts.repeat_interleave(args.group_size, dim=0), tails], dim=1)
    cache = lean.new_cache()
    cache.reserve(rows, args.context + 1)
    positions = torch.arange(args.context)[None]
    for row in range(rows):  # each row's own keys and values, as the engine's prefills leave them
        lean.forward(tokens[row:row + 1], positions, torch.tensor([row]), cache, torch.tensor([args.context]),
                     [adapter])
    leaders = torch.arange(rows) // args.group_size * args.group_size
    shared = (leaders, torch.where(leaders == torch.arange(rows), 0, args.shared))
    step = torch.randint(0, vocab, (rows, 1), generator=generator)
    at = torch.full((rows, 1), args.context)

    def decode(reading: tuple[torch.Tensor, torch.Tensor] | None) -> float:
        started = time.perf_counter()
        lean.forward(step, at, torch.arange(rows), cache, torch.full((rows,), args.context + 1), [adapter] * rows,
                     reading)
        return (time.perf_counter() - started) * 1e3

    ways = {"own copies": None, "shared start": shared}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for reading in ways.values():
        decode(reading)
    for _ in range(args.repeats):
        for name, reading in ways.items():
            times[name].append(decode(reading))
    own, read_once = (statistics.median(times[name]) for name in ways)
    print(f"\n{rows} rows ({args.groups} groups of {args.group_size}) at {args.context} tokens, {args.shared} "
          f"common within a group; {torch.get_num_threads()} threads; medians of {args.repeats} steps")
    print(f"{'keys and values read':<22} | {'ms per decode step':>18}\n" + "-" * 43)
    for name in ways:
        print(f"{name:<22} | {statistics.median(times[name]):>18.1f}")
    print(f"Summary: reading a group's common start once, a decode step takes {read_once:.1f} ms against "
          f"{own:.1f} ms ({own / read_once:.2f}x).")


if __name__ == "__main__":
    main()
