"""Unsloth's `FastLanguageModel` as the trainer's base model on a GPU (the vLLM engine's trainer):
Unsloth's patched forward, fused LoRA kernels and gradient checkpointing, under our GRPO step
(`grpo.py`) and loss (`loss.py`). Imported only on a GPU where `unsloth` is installed.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel
from transformers import PreTrainedModel

# Unsloth's training forward returns empty logits unless asked: our loss needs them (per-token
# logprobs for the importance ratio), not Unsloth's fused cross-entropy.
os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")

from unsloth import FastLanguageModel  # noqa: E402 - after the setting above

logger = logging.getLogger(__name__)


def unsloth_first_adapter(base: PreTrainedModel, config: PeftLoraConfig, name: str) -> tuple[PeftModel, str]:
    model = FastLanguageModel.get_peft_model(
        base, r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(config.target_modules),
        lora_dropout=0.0, bias="none", use_gradient_checkpointing="unsloth")
    return model, model.active_adapter  # Unsloth names its adapter itself


def load_unsloth_model(model_dir: Path, max_seq_length: int) -> PreTrainedModel:
    """Unsloth's model of `model_dir`, in bfloat16, for `unsloth_first_adapter` to wrap."""
    model, _ = FastLanguageModel.from_pretrained(model_name=str(model_dir), max_seq_length=max_seq_length,
                                                 dtype=torch.bfloat16, load_in_4bit=False)
    logger.info("Trainer: Unsloth FastLanguageModel on a GPU copy of %s (bfloat16)", model_dir)
    return model
