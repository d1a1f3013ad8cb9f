"""Attention over prefix-tree rows (packing.py) that computes only the pairs a token may see.

A packed row is a tree flattened depth first, and its 4D mask lets each token see its path from
the root. SDPA with that mask computes every (query, key) pair of the row and throws most away: a
group's four rollouts after a shared 580-token head use about a third of the square. Here a row is
cut into segments, runs of tokens each the parent of the next (the path between two branch
points), and each segment attends in one SDPA call to the keys of its ancestors, all visible, and
to its own, causally:

    out[seg] = softmax(q[seg] [k[anc]; k[seg]]^T * scale + causal) [v[anc]; v[seg]]

Padding sees only itself, so its output is its value. The numbers are those of the masked call up
to float32 rounding (a different order of sums), and so are the gradients.

It runs as a transformers attention implementation ("art_tree", registered on import) that the
trainer switches a model to only around a packed forward and backward (`tree_attention_for`):
every model whose attention goes through transformers' `ALL_ATTENTION_FUNCTIONS` (Llama, Qwen2,
Qwen3, Mistral, ...) takes it; a call without a layout falls back to SDPA with the mask given.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

IMPLEMENTATION = "art_tree"


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of a row, each the parent of the next."""

    start: int
    end: int
    ancestors: list[tuple[int, int]]  # the tokens before it on its path: runs [start, end) of the row, root first
    mask: Tensor | None  # [end - start, ancestors + end - start]: True where a query sees a key; None: no ancestors


@dataclass(frozen=True)
class TreeLayout:
    rows: list[list[Segment]]  # each row's segments, in row order, covering its tokens
    length: int  # the padded row length


def tree_layout(parents: list[list[int]], length: int, device: torch.device) -> TreeLayout:
    """The segments of rows whose token i has parent `parents[row][i]` (-1: a root), parents first."""
    rows: list[list[Segment]] = []
    for row_parents in parents:
        starts = [i for i, parent in enumerate(row_parents) if i == 0 or parent != i - 1]
        ends = [*starts[1:], len(row_parents)]
        paths: list[list[tuple[int, int]]] = []  # each segment's ancestors
        for start in starts:
            parent = row_parents[start]
            if parent < 0:
                paths.append([])
            else:
                owner = bisect.bisect_right(starts, parent) - 1
                paths.append([*paths[owner], (starts[owner], parent + 1)])
        rows.append([_segment(start, end, path, device) for start, end, path in zip(starts, ends, paths)])
    return TreeLayout(rows, length)


def _segment(start: int, end: int, path: list[tuple[int, int]], device: torch.device) -> Segment:
    if not path:
        return Segment(start, end, path, None)
    before = sum(b - a for a, b in path)
    keys = torch.arange(before + end - start, device=device)
    return Segment(start, end, path, keys[None, :] <= before + torch.arange(end - start, device=device)[:, None])


def tree_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None, tree_layout: TreeLayout | None = None,
                   **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface: query [B, heads, L, d], key and value [B, kv_heads, L, d]
    -> [B, L, heads, d]."""
    if tree_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    group = query.shape[1] // key.shape[1]
    rows = []
    for row, segments in enumerate(tree_layout.rows):
        q, k, v = query[row:row + 1], key[row:row + 1], value[row:row + 1]
        parts = []
        for segment in segments:
            span = slice(segment.start, segment.end)
            if not segment.ancestors:
                parts.append(F.scaled_dot_product_attention(q[:, :, span], k[:, :, span], v[:, :, span], is_causal=True,
                                                            dropout_p=dropout, scale=scaling, enable_gqa=True))
            else:  # slices, not an index: their backward is a copy, an index's a scatter-add
                runs = [slice(a, b) for a, b in segment.ancestors] + [span]
                keys = torch.cat([k[:, :, run] for run in runs], dim=2)
                values = torch.cat([v[:, :, run] for run in runs], dim=2)
                parts.append(F.scaled_dot_product_attention(q[:, :, span], keys, values, attn_mask=segment.mask,
                                                            dropout_p=dropout, scale=scaling, enable_gqa=True))
        used = segments[-1].end if segments else 0
        if used < tree_layout.length:  # padding: each token sees only itself
            parts.append(v[:, :, used:].repeat_interleave(group, dim=1))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # the layout is the mask


AttentionInterface.register(IMPLEMENTATION, tree_attention)
AttentionMaskInterface.register(IMPLEMENTATION, _no_mask)


@contextmanager
def tree_attention_for(model: PreTrainedModel) -> Iterator[None]:
    """`model` attends with `tree_attention` within (forwards, and the backwards that recompute
    checkpointed forwards), and as before after."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = IMPLEMENTATION
    try:
        yield
    finally:
        config._attn_implementation = before
