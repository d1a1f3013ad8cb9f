"""Choosing the next token of every row in a decode batch, with the policy's logprob of it.

Per row, in vLLM's order, so both engines sample and report alike:
    1. bias and penalties on the logits (`Penalties.apply`): logit bias (added), repetition
       (vLLM's: the logit of a token already in the prompt or the output is divided by the
       penalty if positive, else multiplied), frequency and presence (OpenAI's: minus the penalty
       times the token's count in the output so far, and minus the presence penalty once it occurs)
    2. divided by the temperature (0: greedy, taken at temperature 1)
    3. truncated, sampled rows only: min-p (tokens below min_p times the top probability),
       top-k, then top-p (the smallest set of the most likely tokens holding `top_p` of the mass)
    4. drawn as vLLM's CPU sampler draws (`gumbel_argmax`): the argmax of the result plus Gumbel
       noise that the row's seed fixes, so a seeded request samples the same tokens on both
       engines (on CPU: vLLM's GPU sampler draws other noise)
The reported logprob (and the top logprobs) is the policy's own at the row's temperature, before
steps 1 and 3 and before a grammar's mask:

    logp_t = log_softmax(logits_t / T)[token_t]        (T = 1 for greedy rows)

which is what the trainer recomputes for the token (`training/trainer.py`), so the importance
ratio of a step is 1 for the policy that sampled it whatever the sampling settings; why that
distribution and not the one drawn from: docs/training/grpo.md.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from art_backend.engine.base import LOWEST_LOGPROB



@dataclass(frozen=True)
class RowSampling:
    temperature: float
    top_p: float
    top_logprobs: int
    generator: torch.Generator | None
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    penalized: bool = False  # bias or penalties change its logits (step 1)

    @property
    def truncates(self) -> bool:
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)


@dataclass
class Penalties:
    """One sequence's penalties and logit bias, and what it has seen so far."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seen: set[int] = field(default_factory=set)  # prompt and output tokens (the repetition penalty's)
    output_counts: Counter[int] = field(default_factory=Counter)

    @classmethod
    def for_prompt(cls, prompt: list[int], frequency: float, presence: float, repetition: float,
                   logit_bias: Mapping[int, float]) -> Penalties | None:
        """None when nothing would change the logits."""
        if not (frequency or presence or repetition != 1.0 or logit_bias):
            return None
        return cls(frequency, presence, repetition, logit_bias, set(prompt) if repetition != 1.0 else set())

    def record(self, token: int) -> None:
        self.output_counts[token] += 1
        if self.repetition != 1.0:
            self.seen.add(token)

    def apply(self, logits: Tensor) -> None:
        """Bias and penalize one row of logits in place."""
        if self.logit_bias:
            ids = torch.tensor(list(self.logit_bias), device=logits.device)
            logits[ids] += torch.tensor(list(self.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if self.repetition != 1.0 and self.seen:
            ids = torch.tensor(sorted(self.seen), device=logits.device)
            values = logits[ids]
            logits[ids] = torch.where(values > 0, values / self.repetition, values * self.repetition)
        if (self.frequency or self.presence) and self.output_counts:
            ids = torch.tensor(list(self.output_counts), device=logits.device)
            counts = torch.tensor(list(self.output_counts.values()), dtype=logits.dtype, device=logits.device)
            logits[ids] -= self.frequency * counts + self.presence


@dataclass(frozen=True)
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per row: (token id, logprob), best first


def truncate(scaled: Tensor, rows: list[RowSampling]) -> Tensor:
    """`scaled` [rows, vocab] (logits over temperature) with what min-p, top-k and top-p cut at
    -inf, each row by its own settings (vLLM's rule at equal probabilities: ties at the cut stay)."""
    device = scaled.device
    min_p = torch.tensor([r.min_p for r in rows], device=device)
    if bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        scaled = scaled.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    ascending, order = scaled.sort(dim=-1)
    vocab = scaled.shape[-1]
    top_k = torch.tensor([r.top_k if 0 < r.top_k < vocab else vocab for r in rows], device=device)
    kth = ascending.gather(1, (vocab - top_k)[:, None])
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    top_p = torch.tensor([r.top_p for r in rows], device=device)
    tail = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p[:, None]  # all but the top_p of the mass
    tail[:, -1] = False
    ascending = ascending.masked_fill(tail, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, ascending)


def _seeds(rows: list[RowSampling], device: torch.device) -> Tensor:
    """Each sampled row's seed for this step's draw, as vLLM's CPU sampler takes it: the next
    randint(0, 2^31) of the row's own generator when seeded, else of torch's; 0 for greedy rows."""
    seeds = torch.zeros(len(rows), dtype=torch.long)
    unseeded = [i for i, r in enumerate(rows) if r.temperature > 0 and r.generator is None]
    if unseeded:
        seeds[unseeded] = torch.randint(0, 2**31, (len(unseeded),), dtype=torch.long)
    for i, row in enumerate(rows):
        if row.temperature > 0 and row.generator is not None:
            seeds[i] = int(torch.randint(0, 2**31, (1,), generator=row.generator, device=row.generator.device))
    return seeds.to(device)


# The Gumbel-max draw of vLLM's CPU sampler, in torch ops (the fused kernels' `gumbel_argmax` is
# its fast twin): token i of a row with seed s gets the noise g_i = -log(-log u_i), with u_i from
# SplitMix64 of (s, i), and the row draws argmax_i scaled_i + g_i, in float64. A seeded request
# then samples the same tokens here as on the vLLM engine.
_GOLDEN = 0x9E3779B97F4A7C15


def _int64(value: int) -> int:
    """A uint64 constant as the int64 with its bits (torch has no uint64 arithmetic; int64 wraps alike)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """The logical right shift of int64 tensors holding uint64 bits."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(z: Tensor) -> Tensor:
    z = (z ^ _shift_right(z, 30)) * _int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _int64(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def gumbel_argmax(scaled: Tensor, seeds: Tensor) -> Tensor:
    """`scaled` [B, vocab] (logits over temperature, -inf where masked), `seeds` [B] int64 -> the
    token each row draws with its seed."""
    index = torch.arange(1, scaled.shape[-1] + 1, dtype=torch.long, device=scaled.device)
    key = _splitmix64(seeds.to(scaled.device))[:, None]
    bits = _shift_right(_splitmix64(key + index * _int64(_GOLDEN)), 11)
    uniform = (bits.double() + 0.5) * 2.0**-53
    return (scaled.double() - torch.log(-torch.log(uniform))).argmax(dim=-1)


def _take_rows(block: Tensor, rows: list[int]) -> Tensor:
    return block if len(rows) == block.shape[0] else block[rows]


def sample(logits: Tensor, rows: list[RowSampling], allowed: Tensor | None = None,
           kernels: Any | None = None, policy_logits: Tensor | None = None) -> Sampled:
    """`logits` [B, vocab] (float32, penalties applied) -> one token per row. `policy_logits`: the
    same before penalties, where a row is `penalized`. `allowed`: [B, vocab] bool, what each row's
    grammar allows (all True for rows without one). `kernels`: the fused CPU ops
    (`cpu_kernels.py`), which draw each row that is not penalized, does not truncate, wants no top
    logprobs and has no grammar that masks tokens at this step. Which way a row goes depends on
    that row alone: the two ways round differently, and a seeded request must draw alike whatever
    rows share its step."""
    if any(r.penalized for r in rows) and policy_logits is None:
        raise ValueError("penalized rows need their policy_logits (the logits before penalties)")
    if kernels is None:
        return _sample_eager(logits, rows, allowed, gumbel_argmax, policy_logits)
    masked = [False] * len(rows) if allowed is None else (~allowed.all(dim=-1)).tolist()
    plain = [not (r.truncates or r.top_logprobs or r.penalized or m) for r, m in zip(rows, masked)]
    fused = [i for i, p in enumerate(plain) if p]
    eager = [i for i, p in enumerate(plain) if not p]
    if not fused:
        return _sample_eager(logits, rows, allowed, kernels.gumbel_argmax, policy_logits)
    fused_rows = [rows[i] for i in fused]
    temperature = torch.tensor([float(r.temperature) for r in fused_rows], device=logits.device)
    tokens, chosen = kernels.sample_tokens(_take_rows(logits, fused).contiguous(), temperature,
                                           _seeds(fused_rows, logits.device))
    if not eager:
        return Sampled(tokens.tolist(), chosen.tolist(), [[] for _ in rows])
    rest = _sample_eager(logits[eager], [rows[i] for i in eager], None if allowed is None else allowed[eager],
                         kernels.gumbel_argmax, None if policy_logits is None else policy_logits[eager])
    out = Sampled([0] * len(rows), [0.0] * len(rows), [[] for _ in rows])
    for i, token, logprob in zip(fused, tokens.tolist(), chosen.tolist()):
        out.token_ids[i], out.logprobs[i] = token, logprob
    for j, i in enumerate(eager):
        out.token_ids[i], out.logprobs[i], out.top[i] = rest.token_ids[j], rest.logprobs[j], rest.top[j]
    return out


def _sample_eager(logits: Tensor, rows: list[RowSampling], allowed: Tensor | None,
                  draw: Callable[[Tensor, Tensor], Tensor], policy_logits: Tensor | None) -> Sampled:
    """`sample` in torch ops but `draw` (`gumbel_argmax` or its kernel): every row, whatever it asks for."""
    device = logits.device
    temperature = torch.tensor([float(r.temperature) for r in rows], device=device)
    seeds = _seeds(rows, device)
    truncated_rows = [i for i, r in enumerate(rows) if r.truncates]
    scale = torch.where(temperature == 0, 1.0, temperature)[:, None]
    scaled = logits / scale
    drawn = scaled if allowed is None else scaled.masked_fill(~allowed, float("-inf"))
    if truncated_rows:
        drawn = drawn.clone() if drawn is scaled else drawn
        drawn[truncated_rows] = truncate(drawn[truncated_rows], [rows[i] for i in truncated_rows])
    reported = torch.log_softmax(scaled if policy_logits is None else policy_logits / scale, dim=-1)

    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    # each pass below reads the whole [B, vocab] block: skip those no row needs
    greedy_rows = [i for i, r in enumerate(rows) if r.temperature == 0]
    if greedy_rows:
        tokens[greedy_rows] = _take_rows(drawn, greedy_rows).argmax(dim=-1)
    sampled_rows = [i for i, r in enumerate(rows) if r.temperature > 0]
    if sampled_rows:
        tokens[sampled_rows] = draw(_take_rows(drawn, sampled_rows).contiguous(), _take_rows(seeds, sampled_rows))

    chosen = reported.gather(1, tokens[:, None])[:, 0].clamp(min=LOWEST_LOGPROB)
    top: list[list[tuple[int, float]]] = [[] for _ in rows]
    k = max(r.top_logprobs for r in rows)
    if k:
        values, ids = reported.topk(k, dim=-1)
        values, ids = values.clamp(min=LOWEST_LOGPROB).tolist(), ids.tolist()
        for i, r in enumerate(rows):
            top[i] = list(zip(ids[i][: r.top_logprobs], values[i][: r.top_logprobs]))
    return Sampled(tokens.tolist(), chosen.tolist(), top)
