"""Weights that are exactly small integers in groups, found and stored as such for `linear_groups`.

The embedded model ships as GGUF: its projections in Q4_1 (along each output's inputs, every 32
weights are s * q + m with q in 0..15) and its embedding, the tied LM head, in Q8_0 (s * q with
q in -127..127), s and m half floats. Converted to float32 the weights still are those values,
exactly, so keeping q with s and m (as the half floats they are) gives back the same float32
weights in 5 or 9 bits a weight instead of 32. A decode step reads every weight once: with ~5x
fewer bytes the embedded model's weights stay in the CPU's caches instead of streaming from
memory every step. The check is exact;
a weight that is not such groups (another model, an adapter merged in) keeps its float32 layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GROUP = 32  # inputs sharing a scale and an offset
TILE = 16  # outputs the kernel computes at once


@dataclass(frozen=True)
class ExactGroups:
    """w[o, i] = scale * q + offset per group, laid out for `linear_groups` (see kernels/int_groups.h)."""

    bits: int  # 4 or 8
    codes: Tensor  # uint8 [out / 16, in * bits / 8, 16]
    scales: Tensor  # float16 [out / 16, in / 32, 16]
    offsets: Tensor  # float16 [out / 16, in / 32, 16]


def as_exact_groups(weight: Tensor) -> ExactGroups | None:
    """`weight` [out, in] float32 as exact 4-bit (Q4_1) or 8-bit (Q8_0) groups, or None."""
    out_size, in_size = weight.shape
    if weight.dtype != torch.float32 or out_size % TILE or in_size % GROUP:
        return None
    groups = weight.reshape(out_size, in_size // GROUP, GROUP)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    # scales rounded to half floats, as stored: with 11 significant bits, s * q is exact in float32
    for bits, scales, offsets in ((4, (high - low) / 15, low),
                                  (8, torch.maximum(high, -low) / 127, None)):
        scales = scales.to(torch.float16).float()
        offsets = -128 * scales if offsets is None else offsets  # Q8_0 as s * (q + 128) - 128 s
        q = torch.where(scales > 0, ((groups - offsets) / scales).round(), 0.0)
        # kept as half floats: the kernel reads half the bytes for them (one row's step ~10% faster)
        halves = offsets.to(torch.float16).float()
        if q.min() >= 0 and q.max() < 2**bits and torch.equal(q * scales + halves, groups):
            return ExactGroups(bits, _codes(q.to(torch.uint8), bits), _tiled(scales.half()), _tiled(halves.half()))
    return None


def _codes(q: Tensor, bits: int) -> Tensor:
    """q [out, in / 32, 32] -> [out / 16, in * bits / 8, 16]: a tile's 16 outputs side by side; in
    4 bits, input 2p in the low nibble and 2p + 1 in the high one."""
    out_size = q.shape[0]
    q = q.reshape(out_size // TILE, TILE, -1)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    return q.transpose(1, 2).contiguous()


def _tiled(per_group: Tensor) -> Tensor:
    """[out, in / 32, 1] -> [out / 16, in / 32, 16]"""
    out_size, groups, _ = per_group.shape
    return per_group.reshape(out_size // TILE, TILE, groups).transpose(1, 2).contiguous()
