"""Attention per prefix-tree segment (training/tree_attention.py) against SDPA with the row's 4D
mask: the segments a row is cut into, and outputs and gradients to float32 rounding."""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from art_backend.training.packing import pack
from art_backend.training.tokenize import TrainSequence
from art_backend.training.tree_attention import tree_attention, tree_layout


def _sequence(tokens: list[int]) -> TrainSequence:
    return TrainSequence(tokens, [False] + [True] * (len(tokens) - 1), [math.nan] * len(tokens), 1.0, 1.0)


def test_a_row_is_cut_where_its_path_branches_and_each_segment_sees_its_ancestors() -> None:
    # [0 1 2 | 3 4] then [5 6] branching after token 1, then [7] after 3; and a second root [8 9]
    parents = [[-1, 0, 1, 2, 3, 1, 5, 3, -1, 8]]
    (row,) = tree_layout(parents, 12, torch.device("cpu")).rows
    assert [(s.start, s.end) for s in row] == [(0, 5), (5, 7), (7, 8), (8, 10)]
    assert [s.ancestors for s in row] == [[], [(0, 2)], [(0, 4)], []]
    assert row[1].mask is not None and row[1].mask.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_tree_attention_gives_the_masked_attention_and_its_gradients() -> None:
    rng = random.Random(0)
    heads, kv_heads, dim = 6, 2, 16
    # groups of rollouts sharing a head, sub-branches sharing a first turn, and a row of its own
    head = [rng.randrange(1000) for _ in range(40)]
    sequences = []
    for group in range(3):
        question = head + [1000 + group] * 5
        turn = [rng.randrange(1000) for _ in range(7)]
        for rollout in range(4):
            tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 30))]
            sequences.append(_sequence(question + (turn if rollout < 2 else []) + tail))
    sequences.append(_sequence([rng.randrange(1000) for _ in range(50)]))
    batches = pack(sequences, 1024)
    assert any(len(b.parents) > 1 for b in batches)  # padding is tested too
    torch.manual_seed(0)
    nested = 0
    for batch in batches:
        rows, length = batch.token_ids.shape
        q = torch.randn(rows, heads, length, dim, requires_grad=True)
        k = torch.randn(rows, kv_heads, length, dim, requires_grad=True)
        v = torch.randn(rows, kv_heads, length, dim, requires_grad=True)
        layout = tree_layout(batch.parents, length, torch.device("cpu"))
        nested += sum(len(segment.ancestors) > 1 for row in layout.rows for segment in row)
        got, _ = tree_attention(torch.nn.Module(), q, k, v, None, scaling=0.25, tree_layout=layout)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.attention_bias(torch.float32), scale=0.25,
                                              enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        upstream = torch.randn_like(want)
        got_grads = torch.autograd.grad(got, (q, k, v), upstream)
        want_grads = torch.autograd.grad(want, (q, k, v), upstream)
        for mine, theirs in zip(got_grads, want_grads):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert nested  # a branch inside a branch: ancestors in more than one run
