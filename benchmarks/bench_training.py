"""Training throughput on CPU: our GRPO `LoraTrainer` against a plain transformers + peft loop.

For each batch shape NxL (default 8x256 and 16x256) one fixed batch is built from random token
ids (seed 0): the first L/4 tokens of each sequence are prompt, the rest are assistant tokens,
advantages alternate +1/-1, and rollout logprobs are the base model's own (so ratios start at 1).
Measured, one optimizer step each, on SmolLM2-135M-Instruct with a LoRA adapter (r=8, alpha=16,
q/k/v/o/gate/up/down):
  ours   `LoraTrainer.step` (CISPO loss, micro-batches of <= 2048 padded tokens, gradient
         clipping, AdamW, and saving the adapter + optimizer state, as the backend does);
  plain  a separate model copy wrapped by `peft.get_peft_model`, the same micro-batches:
         forward, log_softmax, gather, REINFORCE loss -(A * logp * mask).sum() / mask.sum(),
         backward, clip grad norm 1.0, AdamW step (no checkpoint saved);
  TRL    `trl.GRPOTrainer`, only reported as skipped (see `trl_note`).
One warm-up step per system, then `--repeats` timed steps, the systems alternating so machine
noise hits both; reported are median seconds per step and tokens/s.

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
from art_backend.model_store import embedded_model_dir
from art_backend.training.tokenize import TrainSequence
from art_backend.training.trainer import LoraTrainer
from art_integrations.training import LoraConfig, TrainConfig

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


class PlainLoop:
    """The same work written directly against transformers + peft."""

    def __init__(self, model: PreTrainedModel, lora: LoraConfig) -> None:
        config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                lora_dropout=0.0, task_type="CAUSAL_LM")
        self.model = get_peft_model(model, config)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5, weight_decay=0.0)

    def step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        ids = torch.tensor([s.token_ids for s in sequences])
        mask = torch.tensor([s.assistant_mask for s in sequences], dtype=torch.float)[:, 1:]
        adv = torch.tensor([s.advantage for s in sequences])[:, None]
        per_batch = max(1, MICRO_BATCH_TOKENS // ids.shape[1])
        total, loss_sum = mask.sum(), 0.0
        self.model.train()
        for start in range(0, len(sequences), per_batch):
            chunk = slice(start, start + per_batch)
            logits = self.model(input_ids=ids[chunk]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[chunk, 1:, None])[..., 0]
            loss = -(adv[chunk] * logp * mask[chunk]).sum() / total  # accumulates to the batch mean
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
    started = time.perf_counter()
    metrics = fn()
    return time.perf_counter() - started, metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8x256,16x256", help="comma-separated NxL shapes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in b.lower().split("x")) for b in args.batches.split(",")]
    hf_logging.set_verbosity_error()

    model_dir = embedded_model_dir(Path(BackendSettings().cache_dir))
    print(f"model {model_dir}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    ours_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # separate peft wrapping
    lora, config = LoraConfig(), TrainConfig(learning_rate=1e-5)
    batches = {f"{n}x{length}": build_batch(plain_model, n, length) for n, length in shapes}
    trainer, plain = LoraTrainer(ours_model), PlainLoop(plain_model, lora)
    note = trl_note()
    print(note)

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, sequences in batches.items():
            systems: dict[str, Callable[[], dict[str, float]]] = {
                "ours (LoraTrainer)": lambda s=sequences, b=label: trainer.step(
                    f"bench-{b}", s, config, lora, resume_from=None, save_to=Path(tmp) / b),
                "plain transformers+peft": lambda s=sequences: plain.step(s),
            }
            times: dict[str, list[float]] = {name: [] for name in systems}
            for name, fn in systems.items():
                seconds, _ = timed(fn)
                print(f"[{label}] {name}: warm-up {seconds:.1f} s", flush=True)
            for r in range(args.repeats):
                for name, fn in systems.items():
                    seconds, metrics = timed(fn)
                    times[name].append(seconds)
                    print(f"[{label}] {name}: step {r + 1}/{args.repeats} {seconds:.2f} s "
                          f"(loss {metrics['loss']:+.4f}, grad_norm {metrics['grad_norm']:.3f})", flush=True)
            assistant = sum(sum(s.assistant_mask) for s in sequences)
            total = sum(len(s) for s in sequences)
            plain_median = statistics.median(times["plain transformers+peft"])
            for name, samples in times.items():
                median = statistics.median(samples)
                rows.append({"batch": label, "system": name, "seconds_median": median, "seconds": samples,
                             "assistant_tokens_per_s": assistant / median, "total_tokens_per_s": total / median,
                             "ratio_vs_plain": plain_median / median})

    header = f"{'batch':<7} | {'system':<24} | {'s/step (median)':>15} | {'assistant tok/s':>15} | " \
             f"{'total tok/s':>11} | {'ratio vs plain loop':>19}"
    print("\n" + header + "\n" + "-" * len(header))
    for row in rows:
        print(f"{row['batch']:<7} | {row['system']:<24} | {row['seconds_median']:>15.2f} | "
              f"{row['assistant_tokens_per_s']:>15.1f} | {row['total_tokens_per_s']:>11.1f} | "
              f"{row['ratio_vs_plain']:>18.2f}x")
    print(f"({note}; ratio = plain loop s/step / system s/step, above 1 is faster)")
    ours = [r for r in rows if r["system"].startswith("ours")]
    print("Summary: LoraTrainer throughput vs the plain transformers+peft loop: " + ", ".join(
        f"{r['batch']} {r['ratio_vs_plain']:.2f}x ({r['assistant_tokens_per_s']:.0f} assistant tok/s)"
        for r in ours) + f", medians of {args.repeats} steps.")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "trl": note, "repeats": args.repeats}, indent=2))


if __name__ == "__main__":
    main()
