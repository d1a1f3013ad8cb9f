"""How much an example's job learns, over seeds, on each engine: one job per (seed, engine), run
one after another from this clone, side by side within each seed so a noisy machine's drift hits
every engine alike.

Each job is the example's own `train` module, as a user runs it, with its held-out score before and
after training (greedy, the same held-out scenarios for every seed). On the torch engine the job
starts its own backend (`--engine torch`); on the vLLM engine a backend is started from the vLLM
venv (`art-backend serve --engine vllm`) and the job trains through `--backend-url`. Each job gets
a fresh art directory, so nothing resumes.

Prints one row per job (seed, engine, base, the score after an SFT step where the job starts with
one (`-- --sft-demos N`), trained, gain, the job's minutes as it reports them: on torch they include
starting the backend, on vLLM not; and the job process's peak resident memory: on torch the whole
job with its backend, on vLLM the job without it) and a summary per engine: the smallest and median
gain, and how many seeds reached `--target`. With both engines, each seed's vLLM gain minus
its torch gain. Beside each gain (and, after an SFT step, what the GRPO steps added to it) stands
its paired standard error over the held-out scenarios (the per-scenario differences' standard
deviation over the square root of their count, from the job's recorded held-out trajectories):
a difference within about two of them is one these held-out scenarios cannot tell from noise.

    .venv/bin/python benchmarks/bench_learning.py [--example city_facts] [--seeds 10] [--engines torch,vllm]
        [-- extra arguments for the job, e.g. --steps 6]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from art_integrations.observability.stored import read_groups, stored_files
from art_integrations.wire import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"held-out score: base (?P<base>[-\d.]+) -> (?:after SFT (?P<sft>[-\d.]+) -> )?"
                     r"trained (?P<trained>[-\d.]+) \([-+\d.]+\) "
                     r"in (?P<minutes>[\d.]+) min\npeak memory: (?P<peak>[\d.]+) GB")


@dataclass
class Run:
    seed: int
    engine: str
    base: float
    trained: float
    minutes: float
    peak_gb: float
    after_sft: float | None = None  # the held-out score after the job's SFT step (`-- --sft-demos N`)
    gain_se: float | None = None  # paired standard errors over the held-out scenarios (`paired_standard_error`)
    grpo_added_se: float | None = None

    @property
    def gain(self) -> float:
        return round(self.trained - self.base, 3)  # to the job's printed places: 0.950 - 0.375 is not 0.575 in floats

    @property
    def grpo_added(self) -> float | None:
        return None if self.after_sft is None else round(self.trained - self.after_sft, 3)


def held_out_rewards(art_dir: Path) -> list[dict[str, float]]:
    """Each held-out evaluation the job recorded, in step order: scenario id -> reward."""
    (model,) = art_dir.glob("*/models/*")  # a job trains one model, in an art dir of its own
    return [{t.metadata["scenario"]: t.reward for group in read_groups(stored.path) for t in group.trajectories}
            for stored in stored_files(art_dir, model.parent.parent.name, model.name, "val")]


def paired_standard_error(before: dict[str, float], after: dict[str, float]) -> float | None:
    """The standard error of mean(after) - mean(before) over the scenarios both scored: the
    per-scenario differences' sample standard deviation over the square root of their count."""
    differences = [after[s] - before[s] for s in before.keys() & after.keys()]
    return statistics.stdev(differences) / math.sqrt(len(differences)) if len(differences) > 1 else None


def wait_until_serving(url: str, server: subprocess.Popen[bytes], log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the vLLM backend exited with {server.returncode} before serving; its log: {log}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the vLLM backend did not serve within {timeout:.0f} s; its log: {log}")


def run_job(example: str, seed: int, engine: str, job_args: list[str], vllm_python: Path, workdir: Path) -> Run:
    art_dir = workdir / f"{engine}-s{seed}"
    job = [sys.executable, "-m", f"examples.{example}.train", "--seed", str(seed), *job_args]
    server = None
    if engine == "torch":
        job += ["--engine", "torch", "--art-dir", str(art_dir)]
    else:
        port, log = free_loopback_port(), workdir / f"vllm-s{seed}.log"
        server = subprocess.Popen(
            [str(vllm_python), "-m", "art_backend", "serve", "--engine", "vllm", "--port", str(port),
             "--art-dir", str(art_dir)], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
        try:
            wait_until_serving(f"http://127.0.0.1:{port}", server, log)
        except BaseException:
            server.kill()
            raise
        job += ["--backend-url", f"http://127.0.0.1:{port}", "--art-dir", str(art_dir)]
    print(f"seed {seed}, {engine} engine: {' '.join(job[1:])}", flush=True)
    lines: list[str] = []
    try:
        with subprocess.Popen(job, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}) as process:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line.rstrip())
                if line.startswith(("step ", "base model", "trained policy", "SFT step", "after SFT")):
                    print(f"  {line.rstrip()}", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)
    (workdir / f"{engine}-s{seed}.log").write_text("\n".join(lines) + "\n")
    match = SUMMARY.search("\n".join(lines))
    if process.returncode != 0 or match is None:
        tail = "\n".join(lines[-60:])
        raise SystemExit(f"seed {seed} on the {engine} engine failed (exit {process.returncode}):\n{tail}")
    evaluations = held_out_rewards(art_dir)  # base, after the SFT step where there is one, trained
    sft_evaluation = evaluations[1] if match["sft"] is not None and len(evaluations) > 2 else None
    run = Run(seed, engine, float(match["base"]), float(match["trained"]), float(match["minutes"]),
              float(match["peak"]), None if match["sft"] is None else float(match["sft"]),
              gain_se=paired_standard_error(evaluations[0], evaluations[-1]) if len(evaluations) > 1 else None,
              grpo_added_se=None if sft_evaluation is None else paired_standard_error(sft_evaluation, evaluations[-1]))
    sft = "" if run.after_sft is None else f"{run.after_sft:.3f} (SFT) -> "
    print(f"  held-out {run.base:.3f} -> {sft}{run.trained:.3f} ({run.gain:+.3f}{plus_minus(run.gain_se)}) in "
          f"{run.minutes:.1f} min, peak {run.peak_gb:.2f} GB", flush=True)
    return run


def plus_minus(standard_error: float | None) -> str:
    return "" if standard_error is None else f" ±{standard_error:.3f}"


def print_table(runs: list[Run], engines: list[str], target: float) -> None:
    sft = any(r.after_sft is not None for r in runs)  # columns for the score after the SFT step and GRPO's part
    print(f"\n{'seed':>4} {'engine':>7} {'base':>6}" + (f" {'after SFT':>9}" if sft else "")
          + f" {'trained':>8} {'gain ±se':>14}" + (f" {'GRPO added ±se':>14}" if sft else "")
          + f" {'minutes':>8} {'peak GB':>8}")
    for run in runs:
        after_sft = "" if not sft else f" {'-' if run.after_sft is None else f'{run.after_sft:.3f}':>9}"
        added = "" if not sft else (f" {'-':>14}" if run.grpo_added is None
                                    else f" {f'{run.grpo_added:+.3f}{plus_minus(run.grpo_added_se)}':>14}")
        print(f"{run.seed:>4} {run.engine:>7} {run.base:>6.3f}{after_sft} {run.trained:>8.3f} "
              f"{f'{run.gain:+.3f}{plus_minus(run.gain_se)}':>14}{added} {run.minutes:>8.1f} {run.peak_gb:>8.2f}")
    print(f"\n{'engine':>7} {'seeds':>5} {'min gain':>9} {'median gain':>12} {f'gain >= {target:+.2f}':>14} "
          f"{'median min':>11}")
    for engine in engines:
        gains = [r.gain for r in runs if r.engine == engine]
        minutes = [r.minutes for r in runs if r.engine == engine]
        print(f"{engine:>7} {len(gains):>5} {min(gains):>+9.3f} {statistics.median(gains):>+12.3f} "
              f"{sum(g >= target for g in gains):>11}/{len(gains):<2} {statistics.median(minutes):>11.1f}")
        added = [r.grpo_added for r in runs if r.engine == engine and r.grpo_added is not None]
        if added:
            print(f"{'':>7} GRPO added to what SFT reached on {sum(a > 0 for a in added)}/{len(added)} seeds "
                  f"(least {min(added):+.3f})")
    if set(engines) == {"torch", "vllm"}:
        by_seed = {(r.seed, r.engine): r.gain for r in runs}
        seeds = sorted({r.seed for r in runs})
        differences = [round(by_seed[s, "vllm"] - by_seed[s, "torch"], 3) for s in seeds]
        print("\nvLLM gain - torch gain, per seed: "
              + ", ".join(f"seed {s} {d:+.3f}" for s, d in zip(seeds, differences))
              + f"; seeds within 0.05 or above: {sum(d >= -0.05 for d in differences)}/{len(seeds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", default="city_facts", help="a folder of examples/ with a train module")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0 .. N-1")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--engines", default="torch", help="torch, vllm, or torch,vllm")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python",
                        help="the vLLM venv's python (make setup-vllm)")
    parser.add_argument("--target", type=float, default=0.3, help="the gain each seed should reach")
    parser.add_argument("--keep", type=Path, default=None, help="keep every job's art directory (checkpoints, "
                        "history, trajectories) under this folder instead of a temporary one")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="after --: passed to every job")
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := sorted(set(engines) - {"torch", "vllm"}):
        parser.error(f"--engines: {', '.join(unknown)} is not an engine (torch, vllm)")
    if not (ROOT / "examples" / args.example / "train.py").is_file():
        parser.error(f"--example {args.example}: no examples/{args.example}/train.py")
    if "vllm" in engines and not args.vllm_python.is_file():
        parser.error(f"--vllm-python {args.vllm_python} does not exist: `make setup-vllm` makes it")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: run at least one seed")
    job_args = [a for a in args.job_args if a != "--"]
    runs = []
    if args.keep is not None and args.keep.exists() and (not args.keep.is_dir() or any(args.keep.iterdir())):
        parser.error(f"--keep {args.keep} is not an empty folder: name a new one, so no earlier run resumes")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(str(args.keep.resolve())) if args.keep is not None
          else tempfile.TemporaryDirectory(prefix="bench-learning-")) as workdir:
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for engine in engines:
                runs.append(run_job(args.example, seed, engine, job_args, args.vllm_python, Path(workdir)))
    print_table(runs, engines, args.target)


if __name__ == "__main__":
    main()
