"""Host memory reused within a training step or a prefill (engine/step_memory.cpp, engine/host_memory.py):
freed blocks go to the next request of their size, at most REUSE_KEPT_BYTES are kept, everything
kept is freed on leaving, and a step's results do not change beyond float32 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from art_backend.engine.host_memory import REUSE_KEPT_BYTES, reusing_freed_memory
from art_backend.training.grpo import grpo_step
from art_backend.training.trainer import LoraTrainer
from art_integrations.training import LoraConfig, TrainConfig
from tests.conftest import REPO
from tests.test_engine import _kernels_or_skip
from tests.test_packing import captured_sequences

MIB = 2**20


def test_a_freed_block_goes_to_the_next_request_of_its_size() -> None:
    kernels = _kernels_or_skip()
    with reusing_freed_memory(kernels):
        block = torch.empty(MIB)
        address = block.data_ptr()
        del block
        again = torch.empty(MIB)
        assert again.data_ptr() == address
        assert torch.empty(MIB + 1).data_ptr() != address  # another size takes a block of its own
        again.fill_(2.0)
        assert torch.equal(torch._lazy_clone(again), again)  # copy-on-write clones take its blocks
    assert torch.ones(MIB).sum() == MIB  # switched off, it allocates as torch's own does


PROBE = """
import json, torch
from art_backend.engine.cpu_kernels import load_cpu_kernels
from art_backend.engine.host_memory import reusing_freed_memory
from process_memory import resident_mib

kernels = load_cpu_kernels()
assert kernels is not None
before, _ = resident_mib()
with reusing_freed_memory(kernels):
    for i in range(12):  # 12 blocks of 32 MiB and a little, each its own size, touched and freed
        block = torch.ones((8 << 20) + 1024 * i)
        del block
    inside, _ = resident_mib()
    survivor = torch.ones(8 << 20)  # outlives the step, as an optimizer's state does
after, _ = resident_mib()
del survivor
end, _ = resident_mib()
print(json.dumps({"inside": inside - before, "after": after - before, "end": end - before}))
"""


def test_what_is_kept_is_bounded_and_freed_on_leaving() -> None:
    _kernels_or_skip()
    path = os.pathsep.join(str(REPO / part) for part in ("", "backend", "benchmarks"))
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": path})
    assert run.returncode == 0, run.stderr[-3000:]
    grown = json.loads(run.stdout.splitlines()[-1])
    # kept: the newest blocks that fit in REUSE_KEPT_BYTES (7 of the 12), the oldest freed first
    assert REUSE_KEPT_BYTES / MIB - 64 <= grown["inside"] <= REUSE_KEPT_BYTES / MIB + 16, grown
    assert grown["after"] <= 32 + 16, grown  # only the survivor stays
    assert grown["end"] <= 16, grown  # and it is freed when it dies, after the step


def test_a_training_step_gives_the_same_losses_and_weights_with_memory_reused(tiny_model_dir: Path) -> None:
    """The same to float32 rounding: the plain trainer's own runs differ in the last bits from each
    other (the sums of its matmuls follow where their operands lie), so that is the tolerance."""
    kernels = _kernels_or_skip()
    sequences, _ = captured_sequences("city_facts_step.jsonl")
    results = []
    for reuse in (None, kernels):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trainer = LoraTrainer(model, step_memory=reuse)
        with tempfile.TemporaryDirectory() as out:
            metrics = [grpo_step(trainer, "m", sequences, TrainConfig(), LoraConfig(), None, Path(out) / str(i))
                       for i in range(2)]
        weights = {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}
        results.append(([{k: v for k, v in m.items() if not k.endswith("seconds")} for m in metrics], weights))
    (plain_metrics, plain_weights), (reused_metrics, reused_weights) = results
    assert plain_metrics[0]["loss"] != 0 and len(plain_weights) == len(reused_weights) > 0
    torch.testing.assert_close(reused_metrics, plain_metrics, rtol=1e-5, atol=1e-7)
    moved = [(plain_weights[name] - weight).abs().max() for name, weight in reused_weights.items()]
    assert max(moved) < 1e-7, max(moved)  # two Adam steps of lr 1e-5 move each weight by up to 2e-5
