"""One stream and many: the art-backend server against llama.cpp's server, same GGUF weights and threads.

llama.cpp's `llama-server` is built once from the llama.cpp sources vendored in the
llama-cpp-python sdist (cmake and a C++ compiler; a few minutes on 2 cores) and cached under
the backend's cache dir; `--llama-server PATH` uses a binary built elsewhere. It serves the
embedded model's GGUF file itself (projections Q4_1, embedding Q8_0) with `--threads` threads and
one slot per request of the highest concurrency. The backend serves the same file as the engine
loads it: converted to float32, whose values are still exactly those groups (the engine keeps
them as such where its kernel applies: engine/exact_groups.py), with OMP_NUM_THREADS=`--threads`.

For each concurrency N, N distinct chat prompts each get exactly `--new-tokens` new tokens (EOS
ignored, temperature 1), counted from each server's usage. llama.cpp keeps its default sampler
chain (top-k 40, top-p 0.95, min-p 0.05: cheaper than drawing from the whole vocabulary, as the
backend does). Each repeat runs both servers side by side, so a shared machine's drift hits both
alike; printed are medians of rates, medians of the per-repeat ratios, and each server's peak
resident memory over that concurrency's rounds. Targets: backend >= llama.cpp at 1 concurrent,
>= 2x at 16.

Run from the repository root:
    make bench-llamacpp [ARGS="--concurrency 1,16 --new-tokens 128 --repeats 3 --threads 2 --no-amx"]
"""

from __future__ import annotations

import asyncio
import os
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from art_backend.config import BackendSettings
from art_backend.export.llama_cpp import build_tools, start_server
from art_backend.model_store import embedded_gguf_path, resolve_model_dir
from bench_serving import (
    chat_messages,
    concurrent_round,
    median_row,
    print_aligned,
    served_model,
    serving_parser,
)
from openai import AsyncOpenAI
from process_memory import reset_peak, resident_mib

from art_integrations import LocalBackend

TARGETS = {1: 1.0, 16: 2.0}  # concurrency: backend / llama.cpp at least


def bench(binary: Path, levels: list[int], new_tokens: int, repeats: int, threads: int,
          llama_args: list[str]) -> list[dict[str, Any]]:
    logs = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by the backend's process when it starts
    model_dir = resolve_model_dir(None, BackendSettings().cache_dir)  # the GGUF converted, as the backend loads it
    backend = LocalBackend(in_process=False, model=str(model_dir), art_dir=str(logs / "art"),
                           log_file=str(logs / "backend.log"))
    llama, llama_url = start_server(binary, embedded_gguf_path(), threads, max(levels), logs / "llama-server.log",
                                    llama_args)
    print(f"Backend on {backend.base_url}, llama-server on {llama_url}; logs in {logs}", flush=True)
    servers = {"backend": (backend.pid, AsyncOpenAI(base_url=f"{backend.base_url}/v1", api_key="unused",
                                                    max_retries=0, timeout=1800.0)),
               "llama.cpp": (llama.pid, AsyncOpenAI(base_url=f"{llama_url}/v1", api_key="unused",
                                                    max_retries=0, timeout=1800.0))}
    rows = []
    try:
        with asyncio.Runner() as runner:
            names = {name: runner.run(served_model(client)) for name, (_, client) in servers.items()}

            def round_rate(name: str, n: int, tokens: int) -> float:
                started = time.perf_counter()
                runner.run(concurrent_round(servers[name][1], names[name], chat_messages(n), tokens,
                                            return_token_ids=False))
                return n * tokens / (time.perf_counter() - started)

            for name in servers:
                round_rate(name, 1, min(8, new_tokens))  # warm-up
            for n in levels:
                rates: dict[str, list[float]] = {name: [] for name in servers}
                for pid, _ in servers.values():
                    reset_peak(pid)
                for r in range(repeats):
                    for name in servers:
                        rates[name].append(round_rate(name, n, new_tokens))
                    print(f"  N={n:<3} repeat {r + 1}: " + ", ".join(f"{name} {values[-1]:.1f}"
                                                                     for name, values in rates.items()) + " tok/s",
                          flush=True)
                peaks = {name: resident_mib(pid)[1] for name, (pid, _) in servers.items()}
                rows.append({"concurrency": n, **median_row(rates, {"ratio": ("backend", "llama.cpp")}),
                             "backend_peak_mib": peaks["backend"], "llama_peak_mib": peaks["llama.cpp"]})
            for _, client in servers.values():
                runner.run(client.close())
    finally:
        llama.terminate()
        llama.wait(timeout=30)
        backend.stop()
    return rows


def main() -> None:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.set_defaults(concurrency="1,16")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for both servers")
    parser.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: built "
                        "once from llama-cpp-python's sdist into the backend's cache dir)")
    parser.add_argument("--no-amx", action="store_true", help="build and run llama.cpp without ggml's AMX matmul, "
                        "which crashed on a Sapphire Rapids VM (SIGSEGV in ggml_backend_amx_mul_mat)")
    parser.add_argument("--llama-args", default="", help="more llama-server arguments, e.g. '--no-repack'")
    args = parser.parse_args()
    if args.model is not None:
        parser.error("--model: llama.cpp serves the embedded model's GGUF file; this benchmark compares that model only")
    levels = [int(n) for n in args.concurrency.split(",")]
    binary = args.llama_server or build_tools(BackendSettings().cache_dir, ["llama-server"],
                                              amx=not args.no_amx)["llama-server"]
    print(f"The embedded model ({embedded_gguf_path().name}); concurrency {levels}; {args.new_tokens} new tokens; "
          f"{args.repeats} repeat(s); {args.threads} threads each; llama-server {binary.name}, more args: "
          f"{args.llama_args or 'none'}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} "
          "(other load skews these timings)", flush=True)
    started = time.perf_counter()
    rows = bench(binary, levels, args.new_tokens, args.repeats, args.threads, shlex.split(args.llama_args))
    print_aligned(("concurrency", "backend tok/s", "llama.cpp tok/s", "backend / llama.cpp", "backend peak MiB",
                   "llama.cpp peak MiB"),
                  [(f"{row['concurrency']}", f"{row['backend_tok_s']:.1f}", f"{row['llama.cpp_tok_s']:.1f}",
                    f"{row['ratio']:.2f}x", f"{row['backend_peak_mib']:,.0f}", f"{row['llama_peak_mib']:,.0f}")
                   for row in rows])
    print(f"Medians of {args.repeats} repeat(s) (ratios: medians of each repeat's ratio); {args.new_tokens} new "
          "tokens per request; aggregate generated tokens/s.")
    verdicts = [f"at {row['concurrency']} concurrent {row['ratio']:.2f}x (target {TARGETS[row['concurrency']]:g}x: "
                f"{'PASS' if row['ratio'] >= TARGETS[row['concurrency']] else 'FAIL'})"
                for row in rows if row["concurrency"] in TARGETS]
    print(f"Summary: backend / llama.cpp {'; '.join(verdicts) or 'no targeted concurrency run'}; "
          f"took {time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.2f}.")


if __name__ == "__main__":
    main()
