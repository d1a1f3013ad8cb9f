"""peft LoRA adapters for the torch engine: read from a checkpoint directory, fused per projection,
and served by name (`ServedAdapters`, the torch engine's LoRA manager).

An adapter directory holds `adapter_config.json` (rank, alpha, rsLoRA) and
`adapter_model.safetensors` with one A and one B per adapted module, named as peft names them
(`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`). The engine serves it unmerged,
per row (see `LeanLlama`), from B scaled by alpha / r (alpha / sqrt(r) under rsLoRA), as peft does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from art_backend.engine.llama import LORA_TARGETS, LeanLlama, LoraWeights
from art_backend.errors import DamagedCheckpointError
from art_integrations.training import LoraConfig


@dataclass(frozen=True)
class Unread:
    """An adapter served by name but read from `path` only when first asked for."""

    path: Path


def check_servable(lora: LoraConfig) -> None:
    """Raise ValueError, naming the modules, if adapters of this shape cannot be served."""
    unknown = sorted(set(lora.target_modules) - set(LORA_TARGETS))
    if unknown:
        raise ValueError(f"LoRA on {', '.join(unknown)} cannot be served; "
                         f"target modules: {', '.join(LORA_TARGETS)}.")


def read_adapter(path: Path, lean: LeanLlama, device: torch.device) -> LoraWeights:
    """The adapter saved at `path`, in `lean`'s dtype and fused layout."""
    try:
        config = json.loads((path / "adapter_config.json").read_text())
        rank, alpha = config["r"], config["lora_alpha"]
        tensors = load_file(str(path / "adapter_model.safetensors"), device=str(device))
    except Exception as error:  # noqa: BLE001 - every way the files fail to load is damage
        raise DamagedCheckpointError(f"The adapter at {path} does not load: {type(error).__name__}: {error}") \
            from error
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    a: dict[tuple[int, str], torch.Tensor] = {}
    b: dict[tuple[int, str], torch.Tensor] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        if "layers" not in parts or parts[-2] not in ("lora_A", "lora_B"):
            raise ValueError(f"{path}: unexpected adapter tensor {key}; only LoRA on linear layers is served.")
        layer, module = int(parts[parts.index("layers") + 1]), parts[-3]
        if module not in LORA_TARGETS:
            raise ValueError(f"{path}: LoRA on {module} is not supported; targets: {LORA_TARGETS}.")
        if parts[-2] == "lora_A":
            a[(layer, module)] = tensor.to(lean.dtype)
        else:
            b[(layer, module)] = (tensor * scale).to(lean.dtype)
    weights = lean.fuse_lora(a, b)
    weights.source = path
    return weights


class ServedAdapters:
    """The adapters served by name. A checkpoint served under two names is one adapter (its rows
    batch together and share cached prefixes). The adapter loaded last also gets merged weights
    where they are faster (see `LeanLlama.merge`): the rollouts of a training run, which all use
    the newest checkpoint, then decode as fast as the base model; one merged copy at a time, as
    it is as large as the weights. Used on the engine's worker thread only, `resolve` aside."""

    def __init__(self, lean: LeanLlama, device: torch.device, merge: bool) -> None:
        self._lean = lean
        self._device = device
        self._merge = merge
        # None: the base model under another name; Unread: an adapter not read yet
        self._by_name: dict[str, LoraWeights | Unread | None] = {}

    def names(self) -> list[str]:
        return list(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def resolve(self, name: str) -> LoraWeights | Unread | None:
        return self._by_name[name]

    def serve(self, name: str, path: Path | None, preload: bool) -> None:
        """Serve the adapter at `path` (None: the base model) as `name`; `preload=False`: read at
        the first request for `name`, and never merged."""
        if path is None:
            self._by_name[name] = None
            return
        path = Path(path).resolve()
        if not preload:
            self._by_name[name] = Unread(path)
            return
        weights = self._served_from(path) or read_adapter(path, self._lean, self._device)
        if self._merge and weights.merged is None:
            weights.merged = self._lean.merge(weights)
        if weights.merged is not None:
            for other in self._by_name.values():
                if isinstance(other, LoraWeights) and other is not weights:
                    other.merged = None
        self._by_name[name] = weights

    def remove(self, name: str) -> None:
        self._by_name.pop(name, None)

    def read_on_first_use(self, name: str) -> LoraWeights:
        entry = self._by_name[name]
        if isinstance(entry, Unread):
            self._by_name[name] = self._served_from(entry.path) or read_adapter(entry.path, self._lean, self._device)
        weights = self._by_name[name]
        assert isinstance(weights, LoraWeights)
        return weights

    def _served_from(self, path: Path) -> LoraWeights | None:
        return next((w for w in list(self._by_name.values()) if isinstance(w, LoraWeights) and w.source == path),
                    None)
