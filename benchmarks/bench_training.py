"""Training throughput on CPU: our GRPO `LoraTrainer` against a plain transformers + peft loop.

Batches: the real case, one step of the main job (`tests/fixtures/city_facts_step.jsonl`: the
groups a run of `make run` trained its first step on, 3 scenarios x 4 rollouts of the city_facts
LangGraph agent, captured with their exact tokens; every rollout of a group repeats the group's
~580-token head), as the trainer tokenizes it; and for each shape NxL (default 8x256 and
16x256) a fixed batch of random token ids (seed 0) that share nothing: the first L/4 tokens of
each sequence are prompt, the rest are assistant tokens, advantages alternate +1/-1, and rollout
logprobs are the base model's own (so ratios start at 1).
Measured, one optimizer step each, on SmolLM2-135M-Instruct with a LoRA adapter (r=8, alpha=16,
q/k/v/o/gate/up/down):
  ours           `LoraTrainer.step` as the backend runs it (prefix-tree batches of <= 2048 tokens,
                 `training/packing.py`; CISPO loss, gradient clipping, AdamW, and saving the
                 adapter + optimizer state; host memory freed within a step reused, where the
                 CPU kernels build: `engine/host_memory.py`);
  ours, no reuse the same without that reuse: every freed block goes back to the system;
  ours unpacked  the same, each sequence a row of its own (padded micro-batches of <= 2048 tokens);
  plain          a separate model copy wrapped by `peft.get_peft_model`, the same unpacked padded
                 micro-batches: forward, log_softmax, gather, the per-trajectory weighted REINFORCE
                 loss -(A * logp * w).sum(), backward, clip grad norm 1.0, AdamW step (no checkpoint
                 saved);
  TRL            `trl.GRPOTrainer`, only reported as skipped (see `trl_note`).
One warm-up step per system, then `--repeats` timed steps, the systems alternating so machine
noise hits all alike; reported are median seconds per step, tokens/s, and trajectories/s for the
real case (the same trajectories per second is the comparison that counts there).

Run from the repository root:
    PYTHONPATH=backend:. ART_BACKEND_CACHE_DIR=/tmp/artcache python benchmarks/bench_training.py \
        [--batches 8x256,16x256] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from art_backend.config import BackendSettings
from art_backend.engine.cpu_kernels import load_cpu_kernels
from art_backend.engine.host_memory import return_freed_memory_to_os
from art_backend.model_store import embedded_model_dir
from art_backend.training.grpo import grpo_step, step_sequences
from art_backend.training.packing import padded_batches
from art_backend.training.tokenize import TokenizeStats, TrainSequence
from art_backend.training.trainer import LoraTrainer
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup
from process_memory import reset_peak, resident_mib

MICRO_BATCH_TOKENS = 2048


def build_batch(model: PreTrainedModel, n: int, length: int) -> list[TrainSequence]:
    """n random sequences of `length` tokens; rollout logprobs from the (un-adapted) model."""
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (n, length))
    prompt = length // 4
    logprobs = torch.full((n, length), math.nan)
    with torch.no_grad():
        for start in range(0, n, MICRO_BATCH_TOKENS // length):
            chunk = ids[start:start + MICRO_BATCH_TOKENS // length]
            logp = torch.log_softmax(model(input_ids=chunk).logits[:, :-1].float(), dim=-1)
            logprobs[start:start + len(chunk), 1:] = logp.gather(-1, chunk[:, 1:, None])[..., 0]
    logprobs[:, :prompt] = math.nan
    mask = [False] * prompt + [True] * (length - prompt)
    return [TrainSequence(ids[i].tolist(), mask, logprobs[i].tolist(), 1.0 if i % 2 == 0 else -1.0,
                          1.0 / (length - prompt)) for i in range(n)]


def real_step() -> tuple[list[TrainSequence], int]:
    """The main job's first step, as the trainer gets it; and its number of trajectories."""
    fixture = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "city_facts_step.jsonl"
    groups = [TrajectoryGroup.model_validate_json(line) for line in fixture.read_text().splitlines()]
    sequences, _, _ = step_sequences(groups, TrainConfig(), TokenizeStats(), vocabulary=49152)
    return sequences, sum(len(g.trajectories) for g in groups)


class PlainLoop:
    """The same work written directly against transformers + peft."""

    def __init__(self, model: PreTrainedModel, lora: LoraConfig) -> None:
        config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                lora_dropout=0.0, task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.0)

    def step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        total = sum(s.weight * sum(s.assistant_mask) for s in sequences)
        loss_sum = 0.0
        self.model.train()
        for batch in padded_batches(sequences, len, MICRO_BATCH_TOKENS):
            length = len(batch[0])
            ids = torch.tensor([s.token_ids + [0] * (length - len(s)) for s in batch])
            attention = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in batch])
            weights = torch.tensor([[float(m) * s.weight / total for m in s.assistant_mask[1:]]
                                    + [0.0] * (length - len(s)) for s in batch])
            advantages = torch.tensor([s.advantage for s in batch])[:, None]
            logits = self.model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(advantages * logp * weights).sum()  # accumulates to the batch's weighted mean
            loss.backward()
            loss_sum += float(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        return {"loss": loss_sum, "grad_norm": float(grad_norm)}


def trl_note() -> str:
    if importlib.util.find_spec("trl") is None:
        return "TRL: not installed, skipped"
    # GRPOTrainer generates its own completions from a dataset of prompts through a reward
    # function; it has no entry point for one step on fixed token ids and fixed advantages.
    return "TRL: installed, but GRPOTrainer cannot take a fixed pre-tokenized batch; skipped"


def timed(fn: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float]]:
    """The step's seconds and metrics, with `before_mib` (the process's resident memory before it),
    `peak_mib` (its peak during the step over that) and `kept_mib` (resident memory after over before)."""
    before, _ = resident_mib()
    reset_peak()
    started = time.perf_counter()
    metrics = fn()
    seconds = time.perf_counter() - started
    after, peak = resident_mib()
    return seconds, {**metrics, "before_mib": before, "peak_mib": peak - before,
                     "kept_mib": after - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8x256,16x256", help="comma-separated NxL shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in b.lower().split("x")) for b in args.batches.split(",")]
    hf_logging.set_verbosity_error()
    return_freed_memory_to_os()  # as the backend does in its own process (`art-backend serve`)

    model_dir = embedded_model_dir(Path(BackendSettings().cache_dir))
    print(f"model {model_dir}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    ours_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    weight_mib = sum(p.numel() * p.element_size() for p in ours_model.parameters()) / 2**20
    unpacked_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    no_reuse_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # separate peft wrapping
    lora, config = LoraConfig(), TrainConfig(learning_rate=1e-5, micro_batch_tokens=MICRO_BATCH_TOKENS)
    real, trajectories = real_step()
    batches = {"main job step": real,
               **{f"{n}x{length}": build_batch(plain_model, n, length) for n, length in shapes}}
    kernels = load_cpu_kernels()
    trainer, plain = LoraTrainer(ours_model, step_memory=kernels), PlainLoop(plain_model, lora)
    unpacked = LoraTrainer(unpacked_model, packing=False, step_memory=kernels)
    no_reuse = LoraTrainer(no_reuse_model)
    note = trl_note()
    print(note)

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, sequences in batches.items():
            systems: dict[str, Callable[[], dict[str, float]]] = {
                "ours (LoraTrainer)": lambda s=sequences, b=label: grpo_step(
                    trainer, f"bench-{b}", s, config, lora, resume_from=None, save_to=Path(tmp) / b),
                "ours, no memory reuse": lambda s=sequences, b=label: grpo_step(
                    no_reuse, f"bench-{b}", s, config, lora, resume_from=None, save_to=Path(tmp) / f"{b}-no-reuse"),
                "ours unpacked": lambda s=sequences, b=label: grpo_step(
                    unpacked, f"bench-{b}", s, config, lora, resume_from=None, save_to=Path(tmp) / f"{b}-unpacked"),
                "plain transformers+peft": lambda s=sequences: plain.step(s),
            }
            times: dict[str, list[float]] = {name: [] for name in systems}
            peaks: dict[str, list[float]] = {name: [] for name in systems}
            kept: dict[str, list[float]] = {name: [] for name in systems}
            for name, fn in systems.items():
                seconds, _ = timed(fn)
                print(f"[{label}] {name}: warm-up {seconds:.1f} s", flush=True)
            for r in range(args.repeats):
                for name, fn in systems.items():
                    seconds, metrics = timed(fn)
                    times[name].append(seconds)
                    peaks[name].append(metrics["peak_mib"])
                    kept[name].append(metrics["kept_mib"])
                    print(f"[{label}] {name}: step {r + 1}/{args.repeats} {seconds:.2f} s "
                          f"(loss {metrics['loss']:+.4f}, grad_norm {metrics['grad_norm']:.3f}, "
                          f"peak +{metrics['peak_mib']:.0f} MiB, kept {metrics['kept_mib']:+.0f} MiB)", flush=True)
            assistant = sum(sum(s.assistant_mask) for s in sequences)
            total = sum(len(s) for s in sequences)
            plain_median = statistics.median(times["plain transformers+peft"])
            for name, samples in times.items():
                median = statistics.median(samples)
                rows.append({"batch": label, "system": name, "seconds_median": median, "seconds": samples,
                             "assistant_tokens_per_s": assistant / median, "total_tokens_per_s": total / median,
                             "trajectories_per_s": trajectories / median if sequences is real else None,
                             "ratio_vs_plain": plain_median / median,
                             "peak_mib_median": statistics.median(peaks[name]),
                             "kept_mib_median": statistics.median(kept[name])})

    header = f"{'batch':<13} | {'system':<24} | {'s/step (median)':>15} | {'trajectories/s':>14} | " \
             f"{'assistant tok/s':>15} | {'total tok/s':>11} | {'ratio vs plain loop':>19} | " \
             f"{'peak MiB':>8} | {'kept MiB':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for row in rows:
        per_trajectory = f"{row['trajectories_per_s']:.2f}" if row["trajectories_per_s"] is not None else "-"
        print(f"{row['batch']:<13} | {row['system']:<24} | {row['seconds_median']:>15.2f} | {per_trajectory:>14} | "
              f"{row['assistant_tokens_per_s']:>15.1f} | {row['total_tokens_per_s']:>11.1f} | "
              f"{row['ratio_vs_plain']:>18.2f}x | {row['peak_mib_median']:>+8.0f} | {row['kept_mib_median']:>+8.0f}")
    print(f"({note}; ratio = plain loop s/step / system s/step, above 1 is faster; total tokens counted unpacked; "
          "peak: the process's peak resident memory during a step over before it, kept: after it over before it, "
          f"medians; the model's weights are {weight_mib:.0f} MiB)")
    ours = [r for r in rows if r["system"] == "ours (LoraTrainer)"]
    print("Summary: LoraTrainer throughput vs the plain transformers+peft loop: " + ", ".join(
        f"{r['batch']} {r['ratio_vs_plain']:.2f}x ({r['assistant_tokens_per_s']:.0f} assistant tok/s)"
        for r in ours) + f", medians of {args.repeats} steps; target on the main job step: >= 2.5x. Its memory: "
        + ", ".join(f"{r['batch']} peak +{r['peak_mib_median']:.0f} MiB, kept {r['kept_mib_median']:+.0f} MiB"
                    for r in ours) + ".")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "trl": note, "repeats": args.repeats}, indent=2))


if __name__ == "__main__":
    main()
