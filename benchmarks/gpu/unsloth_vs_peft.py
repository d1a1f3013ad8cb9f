"""Unsloth's trainer against peft's on one GRPO step and one SFT pass, on a GPU: the same groups
(the main job's first step, `tests/fixtures/city_facts_step.jsonl`, as the trainer tokenizes it;
for SFT, its rollouts' replies as demonstrations, each token weighing the same), the same LoRA
weights (every A and B set from a seed of its name, so B is not zero and every gradient is), the
same `LoraTrainer` losses; peft's copy runs the step packed into prefix trees, Unsloth's as padded
rows (its attention builds its own causal masks). Each trainer runs in a process of its own
(Unsloth patches transformers when imported), per loss one warm-up pass and then the measured
one: the loss, every LoRA gradient, seconds and peak GPU memory. Passes when, for both losses at
bf16's precision, the losses agree within LOSS_RTOL and the gradients (all LoRA tensors as one
vector) within GRAD_RTOL in norm of their difference, with a cosine of at least GRAD_COSINE.

    python benchmarks/gpu/unsloth_vs_peft.py [--json out.json]      # from the repository root
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the backend's modules import transformers, which a child with Unsloth imports after it
    from art_backend.training.loss import LossConfig
    from art_backend.training.tokenize import TrainSequence
    from art_backend.training.trainer import LoraTrainer

LOSS_RTOL = 2e-2
GRAD_RTOL = 5e-2
GRAD_COSINE = 0.995
MAX_SEQ_LENGTH = 4096


def run_one(trainer_name: str, save: Path) -> None:
    """One trainer's measured step, saved to `save`."""
    if trainer_name == "unsloth":  # before transformers, which Unsloth patches
        from art_backend.training.unsloth import load_unsloth_model, unsloth_first_adapter
    from art_backend.config import BackendSettings
    from art_backend.model_store import embedded_model_dir
    from art_backend.training.sft import SFT_LOSS
    from art_backend.training.base_model import load_peft_model
    from art_backend.training.trainer import LoraTrainer
    from art_integrations.training import LoraConfig
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_training import real_step

    model_dir = embedded_model_dir(BackendSettings().cache_dir)
    loaded = ((load_unsloth_model(model_dir, MAX_SEQ_LENGTH), unsloth_first_adapter, False) if trainer_name == "unsloth"
              else load_peft_model(model_dir))
    trainer = LoraTrainer(*loaded)
    key, params = trainer._adapter("compare", LoraConfig(), None)
    named = {re.sub(rf"\.{re.escape(key)}\.", ".", n): p for n, p in trainer.peft.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for name, p in named.items():
            seeded = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=seeded) * 0.02)
    sequences, _ = real_step()
    trainer.peft.train()
    torch.save({"grpo": measure(trainer, named, sequences, None),
                "sft": measure(trainer, named, sft(sequences), SFT_LOSS),
                "packed": trainer.packing, "tokens": sum(len(s) for s in sequences)}, save)


def sft(sequences: list[TrainSequence]) -> list[TrainSequence]:
    """The rollouts' replies as SFT demonstrations: the same tokens, each of the same weight."""
    from art_backend.training.tokenize import TrainSequence

    return [TrainSequence(s.token_ids, s.assistant_mask, s.logprobs, 1.0, 1.0) for s in sequences]


def measure(trainer: LoraTrainer, named: dict[str, torch.Tensor], sequences: list[TrainSequence],
            losses: LossConfig | None) -> dict:
    """One warm-up pass (kernels compiled, memory pools grown), then the measured one: its loss
    (`losses`: SFT's, else the GRPO loss TrainConfig names), seconds, peak GPU memory, gradients."""
    from art_integrations.training import TrainConfig

    config = TrainConfig()
    cuda = torch.cuda.is_available()
    trainer.accumulate_gradients(sequences, config, losses)
    for p in named.values():
        p.grad = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    sums = trainer.accumulate_gradients(sequences, config, losses)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    grads = {n: p.grad.float().cpu() for n, p in named.items()}
    for p in named.values():
        p.grad = None
    return {"loss": sums["loss"], "seconds": seconds, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "grads": grads}


def compare(peft: dict, unsloth: dict) -> tuple[dict[str, str], bool]:
    assert peft["grads"].keys() == unsloth["grads"].keys(), "the two trainers' LoRA tensors differ"
    names = sorted(peft["grads"])
    a = torch.cat([peft["grads"][n].flatten() for n in names])
    b = torch.cat([unsloth["grads"][n].flatten() for n in names])
    loss_rel = abs(unsloth["loss"] - peft["loss"]) / max(abs(peft["loss"]), 1e-6)
    grad_rel = float((b - a).norm() / a.norm())
    cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    passed = loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL and cosine >= GRAD_COSINE
    rows = {}
    for name, r in (("peft (packed)", peft), ("Unsloth (padded rows)", unsloth)):
        rows[f"{name}: step s / peak GPU MiB / loss"] = (f"{r['seconds']:.3f} / {r['peak_bytes'] / 2**20:.0f} / "
                                                         f"{r['loss']:.5f}")
    rows["loss, relative difference"] = f"{loss_rel:.2e} (at most {LOSS_RTOL:g})"
    rows[f"gradients ({len(names)} LoRA tensors), relative difference"] = f"{grad_rel:.2e} (at most {GRAD_RTOL:g})"
    rows["gradients, cosine"] = f"{cosine:.5f} (at least {GRAD_COSINE:g})"
    rows["verdict"] = "PASS" if passed else "FAIL"
    return rows, passed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", choices=["peft", "unsloth"], help=argparse.SUPPRESS)  # a child's trainer
    parser.add_argument("--save", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.save)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("peft", "unsloth"):
            save = Path(tmp) / f"{name}.pt"
            subprocess.run([sys.executable, __file__, "--one", name, "--save", str(save)], check=True)
            results[name] = torch.load(save, weights_only=True)
    assert results["peft"]["packed"] and not results["unsloth"]["packed"], "not the trainers meant"
    rows, passed = compare(results["peft"]["grpo"], results["unsloth"]["grpo"])
    sft_rows, sft_passed = compare(results["peft"]["sft"], results["unsloth"]["sft"])
    rows.update({f"SFT: {key}": value for key, value in sft_rows.items()})
    passed = passed and sft_passed
    rows["verdict"] = "PASS" if passed else "FAIL"  # both losses'
    width = max(map(len, rows))
    print(f"One GRPO step and one SFT pass on {results['peft']['tokens']} tokens, SmolLM2-135M in bfloat16, {torch.cuda.get_device_name()}")
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows.items()))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
