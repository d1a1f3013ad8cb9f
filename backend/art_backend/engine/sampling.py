"""Choosing the next token of every row in a decode batch, with the policy's own logprobs.

The logprob reported for a token is log softmax(logits / temperature) at that token: the
model's distribution at the sampling temperature, before top-p truncation and before any
grammar mask, which is what the trainer recomputes for the importance ratio. Temperature 0
means greedy, with temperature-1 logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    top_logprobs: int
    generator: torch.Generator | None


@dataclass(frozen=True)
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row: (token id, logprob), best first


def _keep_top_p(probs: Tensor, top_p: Tensor) -> Tensor:
    """Zero the tail of each row outside its smallest set of tokens with mass >= top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _take_rows(block: Tensor, rows: list[int]) -> Tensor:
    return block if len(rows) == block.shape[0] else block[rows]


def _uniforms(rows: list[RowSampling], device: torch.device) -> Tensor:
    """One uniform draw in [0, 1) per sampled row, from the row's own generator when seeded; 0
    for greedy rows."""
    uniform = torch.zeros(len(rows), device=device)
    unseeded = [i for i, r in enumerate(rows) if r.temperature > 0 and r.generator is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), device=device)
    for i, row in enumerate(rows):
        if row.temperature > 0 and row.generator is not None:
            uniform[i] = torch.rand((), device=device, generator=row.generator)
    return uniform


def sample(logits: Tensor, rows: list[RowSampling], allowed_logits: Tensor | None = None,
           kernels: Any | None = None) -> Sampled:
    """`logits` [B, vocab] (float32) -> one token per row. `allowed_logits`: the same logits with
    tokens a grammar forbids set to -inf; tokens are then drawn from those. `kernels`: the fused
    CPU ops (`cpu_kernels.py`), used when no row needs top-p, top logprobs or a grammar."""
    device = logits.device
    temperature = torch.tensor([float(r.temperature) for r in rows], device=device)
    uniform = _uniforms(rows, device)
    if kernels is not None and allowed_logits is None and all(r.top_p >= 1.0 and not r.top_logprobs for r in rows):
        tokens, chosen = kernels.sample_tokens(logits, temperature, uniform)
        return Sampled(tokens.tolist(), chosen.tolist(), [[] for _ in rows])

    scale = torch.where(temperature == 0, 1.0, temperature)[:, None]
    logprobs = torch.log_softmax(logits / scale, dim=-1)
    drawn_from = logprobs if allowed_logits is None else torch.log_softmax(allowed_logits / scale, dim=-1)
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    # each pass below reads the whole [B, vocab] block: skip those no row needs
    greedy_rows = [i for i, r in enumerate(rows) if r.temperature == 0]
    if greedy_rows:
        tokens[greedy_rows] = _take_rows(drawn_from, greedy_rows).argmax(dim=-1)

    sampled_rows = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled_rows:
        probs = _take_rows(drawn_from, sampled_rows).exp()
        top_p = torch.tensor([rows[i].top_p for i in sampled_rows], device=device)
        if bool((top_p < 1.0).any()):
            probs = _keep_top_p(probs, top_p)
        # inverse-CDF sampling: one batched searchsorted instead of a multinomial call per row
        cdf = probs.cumsum(dim=-1)
        picked = torch.searchsorted(cdf, (uniform[sampled_rows] * cdf[:, -1])[:, None], right=True)[:, 0]
        tokens[sampled_rows] = picked.clamp_(max=probs.shape[-1] - 1)

    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    k = max(r.top_logprobs for r in rows)
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, r in enumerate(rows):
            top[i] = list(zip(ids[i][: r.top_logprobs], values[i][: r.top_logprobs]))
    return Sampled(tokens.tolist(), chosen.tolist(), top)
