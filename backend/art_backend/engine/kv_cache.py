"""The torch engine's KV cache: each active sequence's keys and values, in slots.

A slot per sequence (vLLM pages its cache in blocks; at the torch engine's batch sizes on CPU a
contiguous slot per row lets a decode step read one plain view), grown as a batch needs and given
back when the engine goes idle.
"""

from __future__ import annotations

import torch
from torch import Tensor

KV_GROWTH_TOKENS = 256  # a sequence's room in the KV cache grows by this many tokens at a time


class KVCache:
    """Keys and values for up to `slots` sequences of up to `capacity` tokens, grown on demand.

    One tensor per layer, each [slots, kv_heads, capacity, head_dim], so that growing copies one
    layer at a time: grown whole, the old and the new cache both existed during the copy (64
    requests of 542 tokens, SmolLM2-135M in float32: 1.5 GB and 2.25 GB held at once). Active
    sequences are kept in slots 0..B-1 so that a decode step reads a plain view of the first B.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, slots: int = 8, capacity: int = KV_GROWTH_TOKENS) -> None:
        self.k = [torch.zeros(slots, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(layer) for layer in self.k]
        self.initial = (slots, capacity)

    def release(self) -> None:
        """Back to the first size, once no sequence is active: a batch's cache (16 slots of 1,024
        tokens of SmolLM2-135M in float32 is 0.75 GB) would otherwise be held through a training
        step and the idle time after it. Growing again costs a zero-fill, not a copy."""
        if (self.slots, self.capacity) != self.initial:
            self._resize(*self.initial, keep=False)

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        layer = self.k[0]
        return 2 * len(self.k) * layer.shape[1] * layer.shape[3] * layer.element_size()

    def reserve(self, slots: int, capacity: int) -> None:
        """Grow so that `slots` sequences of `capacity` tokens fit: slots by doubling, tokens to the
        next multiple of KV_GROWTH_TOKENS. Doubling the tokens too would hold up to twice what a
        batch needs: 64 requests of 542 tokens took 1,024-token slots, 1.5 GB more for SmolLM2."""
        new_slots = self.slots
        while new_slots < slots:
            new_slots *= 2
        new_capacity = max(self.capacity, -(-capacity // KV_GROWTH_TOKENS) * KV_GROWTH_TOKENS)
        if (new_slots, new_capacity) != (self.slots, self.capacity):
            self._resize(new_slots, new_capacity, keep=True)

    def _resize(self, slots: int, capacity: int, keep: bool) -> None:
        for layers in (self.k, self.v):
            for i, old in enumerate(layers):
                new = old.new_zeros(slots, old.shape[1], capacity, old.shape[3])
                if keep:
                    new[: old.shape[0], :, : old.shape[2]] = old
                layers[i] = new  # the old layer is freed here, before the next one is made

    def move(self, src: int, dst: int, length: int) -> None:
        for layer in (*self.k, *self.v):
            layer[dst, :, :length] = layer[src, :, :length]

    def export(self, slot: int, length: int) -> tuple[Tensor, Tensor]:
        """Slot `slot`'s first `length` tokens, as [layers, kv_heads, length, head_dim] copies."""
        return (torch.stack([layer[slot, :, :length] for layer in self.k]),
                torch.stack([layer[slot, :, :length] for layer in self.v]))

    def load(self, slot: int, k: Tensor, v: Tensor, length: int) -> None:
        for i in range(len(self.k)):
            self.k[i][slot, :, :length] = k[i, :, :length]
            self.v[i][slot, :, :length] = v[i, :, :length]
