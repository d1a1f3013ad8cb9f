"""The pipeline (ART's PipelineTrainer, `--pipeline`) against the synchronous loop on the main job,
with tools and a judge that wait: steps per minute and held-out gain, and the bound overlap allows.

For each tool wait (--tool-seconds, default 0 2 5) and seed, the main job runs twice, side by side:
the loop, then the pipeline, each as a user runs it (`python -m examples.city_facts.train --engine
torch --tool-seconds W --judge-seconds J [--pipeline]`) in a fresh art directory, so nothing
resumes. Each job reports its held-out gain and its training phase's steps per minute (held-out
scoring and the backend's start left out). The synchronous job's step lines give a step's parts,
each the median over its steps: rollouts R (the gather's wall time: decoding plus waiting), training
T (the train call), and the waiting W on a rollout's path (one tool call, then the judge: the main
job's agent looks up once), so decoding D = R - W.

On one CPU the engine cannot decode while it trains, so overlap can at best hide the shorter of
training and waiting: a step takes at least max(D + T, R) (the engine busy, one rollout's wall
time), against R + T in the loop. The bound on steps per minute is 60 / max(D + T, R).

    .venv/bin/python benchmarks/bench_pipeline.py [--tool-seconds 0 2 5] [--judge-seconds 1] [--seeds 3]
        [--engine torch|vllm] [--json FILE] [-- extra arguments for every job, e.g. --steps 6]

(`--engine vllm` runs where vLLM imports: the GPU kit's pipeline stage, benchmarks/gpu/check.sh.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_learning import SUMMARY

ROOT = Path(__file__).resolve().parents[1]
SYNC_STEP = re.compile(r"^step \d+/\d+: .*rollouts (?P<rollouts>[\d.]+) s, .*train\(\) returned in (?P<train>[\d.]+) s",
                       re.MULTILINE)
PIPELINE = re.compile(r"^pipeline: (?P<steps>\d+) steps .*median train (?P<train>[\d.]+) s; (?P<groups>\d+) groups "
                      r"trained, .* (?P<rollouts>\d+) rollouts \(", re.MULTILINE)
TRAINING = re.compile(r"^training: (?P<steps>\d+) steps in (?P<seconds>[\d.]+) s, (?P<rate>[\d.]+) steps/min",
                      re.MULTILINE)


@dataclass
class Job:
    mode: str  # "loop" or "pipeline"
    tool_seconds: float
    seed: int
    gain: float
    steps_per_minute: float
    train: float  # the median train call, seconds
    rollouts_per_step: float
    groups_per_step: float  # groups trained (with signal)
    rollout_seconds: float | None = None  # the loop's median R per step
    sleep_wake: tuple[float, float] | None = None  # the engine's median pause and resume per step (vLLM's sleep)


def rollouts_per_loop_step(job_args: list[str]) -> int:
    """--scenarios-per-step x --rollouts, as the jobs are given them (else the main job's own)."""
    sys.path.insert(0, str(ROOT))
    from examples.city_facts.rollout import EXAMPLE

    parser = argparse.ArgumentParser()
    parser.add_argument("--scenarios-per-step", type=int, default=EXAMPLE.scenarios_per_step)
    parser.add_argument("--rollouts", type=int, default=EXAMPLE.rollouts)
    known, _ = parser.parse_known_args(job_args)
    return known.scenarios_per_step * known.rollouts


def engine_pauses(art_dir: Path) -> tuple[float, float] | None:
    """The median seconds the engine took to pause for a step and to resume after it, from the
    steps' records (the vLLM engine's sleep and wake; None where the engine does not pause so)."""
    records = [json.loads(line) for path in art_dir.glob("*/models/*/history.jsonl")
               for line in path.read_text().splitlines()]
    pauses = [(r["pause_seconds"], r["resume_seconds"]) for r in records
              if r.get("split") == "train" and "pause_seconds" in r and "resume_seconds" in r]
    if not pauses:
        return None
    return statistics.median(p for p, _ in pauses), statistics.median(r for _, r in pauses)


def run_job(mode: str, tool_seconds: float, judge_seconds: float, seed: int, engine: str, job_args: list[str],
            workdir: Path) -> Job:
    name = f"{mode}-w{tool_seconds:g}-s{seed}"
    job = [sys.executable, "-m", "examples.city_facts.train", "--engine", engine, "--seed", str(seed),
           "--tool-seconds", str(tool_seconds), "--judge-seconds", str(judge_seconds),
           "--art-dir", str(workdir / name), *(["--pipeline"] if mode == "pipeline" else []), *job_args]
    print(f"{name}: {' '.join(job[1:])}", flush=True)
    result = subprocess.run(job, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (workdir / f"{name}.log").write_text(f"$ {' '.join(job[1:])}\n{result.stdout}{result.stderr}")
    if result.returncode != 0:
        raise SystemExit(f"{name} failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
    run = read_job(mode, tool_seconds, seed, result.stdout, job_args, workdir)
    print(f"  held-out gain {run.gain:+.3f}, {run.steps_per_minute:.2f} steps/min, train {run.train:.1f} s a step, "
          f"{run.rollouts_per_step:.0f} rollouts and {run.groups_per_step:.1f} groups trained a step"
          + (f", rollouts {run.rollout_seconds:.1f} s a step" if run.rollout_seconds else ""), flush=True)
    return run


def read_job(mode: str, tool_seconds: float, seed: int, text: str, job_args: list[str], workdir: Path) -> Job:
    """A job's figures from its output."""
    name = f"{mode}-w{tool_seconds:g}-s{seed}"
    summary, training = SUMMARY.search(text), TRAINING.search(text)
    if summary is None or training is None:
        raise SystemExit(f"{name}: no held-out summary or training line in its output (see {workdir / name}.log)")
    gain, rate = round(float(summary["trained"]) - float(summary["base"]), 3), float(training["rate"])
    if mode == "loop":
        steps = SYNC_STEP.findall(text)
        trained = [int(g) for g in re.findall(r"groups trained (\d+)/", text)]
        run = Job(mode, tool_seconds, seed, gain, rate, statistics.median(float(t) for _, t in steps),
                  rollouts_per_loop_step(job_args), statistics.fmean(trained),
                  statistics.median(float(r) for r, _ in steps))
    else:
        line = PIPELINE.search(text)
        if line is None:
            raise SystemExit(f"{name}: no pipeline summary line in its output (see {workdir / name}.log)")
        steps_done = int(line["steps"])
        run = Job(mode, tool_seconds, seed, gain, rate, float(line["train"]), int(line["rollouts"]) / steps_done,
                  int(line["groups"]) / steps_done)
    run.sleep_wake = engine_pauses(workdir / name)
    return run


def read_jobs(workdir: Path) -> list[Job]:
    """Every job whose log a run left in `workdir` (--keep), for --report."""
    jobs = []
    for log in sorted(workdir.glob("*.log")):
        match = re.fullmatch(r"(?P<mode>loop|pipeline)-w(?P<tools>[\d.]+)-s(?P<seed>\d+)\.log", log.name)
        if match is None:
            continue
        text = log.read_text()
        command = text.splitlines()[0][2:].split() if text.startswith("$ ") else []
        jobs.append(read_job(match["mode"], float(match["tools"]), int(match["seed"]), text, command, workdir))
    if not jobs:
        raise SystemExit(f"--report {workdir}: no job logs there (a run with --keep {workdir} leaves them)")
    return jobs


def bound(loop: Job, waiting: float, work: Job | None = None) -> float:
    """60 / max(D + T, R): the steps per minute overlap allows at best, from the loop's parts; with
    `work`, for steps that decode `work`'s rollouts (D in proportion) and train as long as its."""
    assert loop.rollout_seconds is not None
    decoding = max(loop.rollout_seconds - waiting, 0.0)
    train = loop.train
    if work is not None:
        decoding *= work.rollouts_per_step / loop.rollouts_per_step
        train = work.train
    return 60 / max(decoding + train, loop.rollout_seconds)


def print_tables(jobs: list[Job], judge_seconds: float) -> dict[str, dict[str, float]]:
    """A row per (tool wait, seed), then the medians per tool wait. `bound` is from the loop's parts;
    `bound, its work` for steps as the pipeline's are: it replaces a group whose rollouts all scored
    alike (ART's rule), so its steps decode more rollouts and train more groups than the loop's,
    which trains such a group as nothing. Rollouts per minute compare the work done either way, groups
    trained (with signal) per minute what it buys."""
    print(f"\n{'tools s':>7} {'seed':>4} {'R s':>5} {'T s':>5} {'loop/min':>8} {'pipe/min':>8} {'bound':>6} "
          f"{'pipe/bound':>10} {'bound, its work':>15} {'pipe/that':>9} {'rollouts/min':>12} {'groups/step':>11} "
          f"{'loop gain':>9} {'pipe gain':>9}")
    rows: dict[float, list[tuple[float, ...]]] = {}
    for loop in (j for j in jobs if j.mode == "loop"):
        pipe = next((j for j in jobs if j.mode == "pipeline" and (j.tool_seconds, j.seed) == (loop.tool_seconds,
                                                                                           loop.seed)), None)
        if pipe is None:  # (--report on a run still going)
            continue
        waiting = loop.tool_seconds + judge_seconds
        best, best_same_work = bound(loop, waiting), bound(loop, waiting, pipe)
        rollout_rates = (loop.steps_per_minute * loop.rollouts_per_step, pipe.steps_per_minute * pipe.rollouts_per_step)
        group_rates = (loop.steps_per_minute * loop.groups_per_step, pipe.steps_per_minute * pipe.groups_per_step)
        print(f"{loop.tool_seconds:>7g} {loop.seed:>4} {loop.rollout_seconds:>5.1f} {loop.train:>5.1f} "
              f"{loop.steps_per_minute:>8.2f} {pipe.steps_per_minute:>8.2f} {best:>6.2f} "
              f"{pipe.steps_per_minute / best:>10.2f} {best_same_work:>15.2f} {pipe.steps_per_minute / best_same_work:>9.2f} "
              f"{f'{rollout_rates[0]:.0f} -> {rollout_rates[1]:.0f}':>12} "
              f"{f'{loop.groups_per_step:.1f}, {pipe.groups_per_step:.1f}':>11} {loop.gain:>+9.3f} {pipe.gain:>+9.3f}")
        rows.setdefault(loop.tool_seconds, []).append((loop.steps_per_minute, pipe.steps_per_minute, best,
                                                       best_same_work, *rollout_rates, *group_rates, loop.gain,
                                                       pipe.gain))
    print(f"\nmedians over seeds (the judge waits {judge_seconds:g} s; groups/step: loop, pipeline)")
    print(f"{'tools s':>7} {'seeds':>5} {'loop/min':>8} {'pipe/min':>8} {'pipe/loop':>9} {'bound':>6} {'pipe/bound':>10} "
          f"{'bound, its work':>15} {'pipe/that':>9} {'rollouts/min':>12} {'groups/min':>12} "
          f"{'pipe gain >= loop gain - 0.05':>30}")
    medians: dict[str, dict[str, float]] = {}
    for tools, values in sorted(rows.items()):
        loop_rate, pipe_rate, best, best_same_work, loop_rollouts, pipe_rollouts, loop_groups, pipe_groups = (
            statistics.median(v[i] for v in values) for i in range(8))
        kept = sum(pipe_gain >= loop_gain - 0.05 for *_, loop_gain, pipe_gain in values)
        medians[f"{tools:g}"] = {"loop_steps_per_minute": loop_rate, "pipeline_steps_per_minute": pipe_rate,
                                 "bound": best, "bound_its_work": best_same_work, "loop_rollouts_per_minute":
                                 loop_rollouts, "pipeline_rollouts_per_minute": pipe_rollouts,
                                 "loop_groups_per_minute": loop_groups, "pipeline_groups_per_minute": pipe_groups,
                                 "seeds_gain_kept": kept, "seeds": len(values)}
        print(f"{tools:>7g} {len(values):>5} {loop_rate:>8.2f} {pipe_rate:>8.2f} {pipe_rate / loop_rate:>9.2f} "
              f"{best:>6.2f} {pipe_rate / best:>10.2f} {best_same_work:>15.2f} {pipe_rate / best_same_work:>9.2f} "
              f"{f'{loop_rollouts:.0f} -> {pipe_rollouts:.0f}':>12} {f'{loop_groups:.1f} -> {pipe_groups:.1f}':>12} "
              f"{f'{kept}/{len(values)}':>30}")
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tool-seconds", type=float, nargs="+", default=[0.0, 2.0, 5.0])
    parser.add_argument("--judge-seconds", type=float, default=1.0, help="each rollout's wait for its score")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1")
    parser.add_argument("--engine", default="torch", choices=["torch", "vllm"], help="every job's engine")
    parser.add_argument("--keep", type=Path, default=None, help="keep every job's art directory and log here")
    parser.add_argument("--json", type=Path, default=None, help="also write every job and the medians here")
    parser.add_argument("--report", type=Path, default=None, help="run nothing: print the tables of the jobs a run "
                        "kept in this folder (--keep)")
    parser.add_argument("job_args", nargs=argparse.REMAINDER, help="after --: passed to every job")
    args = parser.parse_args()
    if args.seeds < 1 or min(args.tool_seconds) < 0 or args.judge_seconds < 0:
        parser.error("--seeds counts from 1; --tool-seconds and --judge-seconds are 0 or more")
    if args.keep is not None and args.keep.exists() and any(args.keep.iterdir()):
        parser.error(f"--keep {args.keep} is not empty: name a new folder, so no earlier run resumes")
    job_args = [a for a in args.job_args if a != "--"]
    if args.report is not None:
        jobs = read_jobs(args.report)
        medians = print_tables(jobs, args.judge_seconds)
    else:
        jobs = []
        with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as scratch:
            workdir = args.keep or Path(scratch)
            workdir.mkdir(parents=True, exist_ok=True)
            for tools in args.tool_seconds:
                for seed in range(args.seeds):
                    for mode in ("loop", "pipeline"):  # side by side: a noisy machine's drift hits both alike
                        jobs.append(run_job(mode, tools, args.judge_seconds, seed, args.engine, job_args, workdir))
            medians = print_tables(jobs, args.judge_seconds)
    if args.json is not None:
        args.json.write_text(json.dumps({"engine": args.engine, "judge_seconds": args.judge_seconds,
                                         "jobs": [asdict(j) for j in jobs], "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
