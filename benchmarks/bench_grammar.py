"""Pick a grammar library by measurement: llguidance vs xgrammar on the embedded tokenizer.

For a tool-call JSON schema, measures the grammar compile time and the time to compute the
next-token mask at every step of a valid 60-token JSON answer (the per-step cost constrained
decoding adds to each sequence). Prints a table of medians.

    python benchmarks/bench_grammar.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from art_backend.config import BackendSettings
from art_backend.model_store import embedded_model_dir

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "search_inbox"},
        "arguments": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                           "folders": {"type": "array", "items": {"enum": ["inbox", "sent", "archive"]}}},
            "required": ["query", "limit", "folders"],
        },
    },
    "required": ["name", "arguments"],
}
ANSWER = json.dumps({"name": "search_inbox", "arguments": {
    "query": "quarterly report from the finance team about the budget", "limit": 10, "folders": ["inbox", "archive"]}})


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def bench_llguidance(tokenizer, ids: list[int]) -> tuple[float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    started = time.perf_counter()
    matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s = time.perf_counter() - started
    bitmask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    steps = []
    for token in ids:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        steps.append(time.perf_counter() - started)
        assert matcher.consume_token(token), matcher.get_error()
    return compile_s * 1000, median_ms(steps)


def bench_xgrammar(tokenizer, ids: list[int], vocab_size: int) -> tuple[float, float]:
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - started
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    steps = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        steps.append(time.perf_counter() - started)
        assert matcher.accept_token(token)
    return compile_s * 1000, median_ms(steps)


def main() -> None:
    model_dir: Path = embedded_model_dir(BackendSettings().cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "llguidance": lambda: bench_llguidance(tokenizer, ids),
        "xgrammar": lambda: bench_xgrammar(tokenizer, ids, len(tokenizer)),
    }
    print(f"JSON answer of {len(ids)} tokens, vocabulary {len(tokenizer)}; torch threads {torch.get_num_threads()}")
    print(f"{'library':<12} {'compile ms':>11} {'mask ms/token':>14}   (medians of 5 runs)")
    for name, run in runs.items():
        results = [run() for _ in range(5)]
        print(f"{name:<12} {statistics.median(r[0] for r in results):>11.2f} "
              f"{statistics.median(r[1] for r in results):>14.3f}")


if __name__ == "__main__":
    main()
