"""The trainer's base model: transformers' (peft's LoRA), or Unsloth's `FastLanguageModel` on a
GPU where Unsloth imports (`unsloth.py`), for a trainer beside another engine's serving weights
(the vLLM engine's); and how each wraps it in its first adapter.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

logger = logging.getLogger(__name__)

# Wraps the base model in its first adapter; returns the PeftModel and that adapter's name.
FirstAdapter = Callable[[PreTrainedModel, PeftLoraConfig, str], tuple[PeftModel, str]]


def peft_first_adapter(base: PreTrainedModel, config: PeftLoraConfig, name: str) -> tuple[PeftModel, str]:
    with warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing`: its warning is not the user's to act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(base, config, adapter_name=name), name


def load_trainable_model(model_dir: Path, max_seq_length: int) -> tuple[PreTrainedModel, FirstAdapter, bool]:
    """A copy of the base model for training beside another engine's serving weights: Unsloth's
    on a GPU where `unsloth` imports (its kernels, our loss), else transformers' (float32 on CPU,
    the precision the torch engine serves and the importance ratio compares; bfloat16 on a GPU);
    and whether its steps can run packed (see `LoraTrainer`)."""
    if torch.cuda.is_available():
        if importlib.util.find_spec("unsloth") is None:
            logger.info("Trainer: Unsloth is not installed (art-backend[unsloth]); training with peft")
        else:
            try:
                # optional: Unsloth, on a GPU
                from art_backend.training.unsloth import load_unsloth_model, unsloth_first_adapter
            except Exception as error:  # noqa: BLE001 - Unsloth refuses some GPUs and versions at import
                logger.warning("Unsloth is installed but does not import (%r); training with peft instead", error)
            else:
                try:
                    # no packing: Unsloth's attention builds its own causal masks, so a prefix tree's 4D
                    # mask would not be applied as given
                    return load_unsloth_model(model_dir, max_seq_length), unsloth_first_adapter, False
                except Exception as error:  # noqa: BLE001 - e.g. Unsloth 2026.10 loads nothing without bitsandbytes
                    logger.warning("Unsloth imports but cannot load %s (%r); training with peft instead",
                                   model_dir, error)
    return load_peft_model(model_dir)


def load_peft_model(model_dir: Path) -> tuple[PreTrainedModel, FirstAdapter, bool]:
    """transformers' model for peft's LoRA (float32 on CPU, bfloat16 on a GPU), trained packed."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    logger.info("Trainer: peft LoRA on a %s copy of %s (%s)", device, model_dir, dtype)
    return model, peft_first_adapter, True
