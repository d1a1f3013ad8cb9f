"""The GRPO policy loss, top to bottom.

For every token t the policy produced in a rollout:

    ratio_t = exp(logp_new_t - logp_rollout_t)          importance weight vs the rollout policy
                                                          (both the policy's own at the rollout's
                                                          temperature: docs/training/grpo.md)
    A_t     = advantage of the token's trajectory        (r - mean(r_group)) / (std(r_group) + 1e-6)
                                                          (or r - mean(r_group): scale_rewards=False)

CISPO (default), a clipped-importance-weight REINFORCE:

    loss_t = -clip(ratio_t, 1 - eps, 1 + eps_high).detach() * A_t * logp_new_t

PPO-clip (option):

    loss_t = -min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t)

ART's importance_sampling_level replaces ratio_t by its sequence's ratio s_i (GSPO's), the
geometric mean of its tokens' ratios, or a mean of the two:

    s_i = exp(mean_{u in T_i} log ratio_u) = (prod_{u in T_i} ratio_u)^(1 / |T_i|)
    "sequence": s_i     "average": (ratio_t + s_i) / 2     "geometric_average": sqrt(ratio_t * s_i)

s_i's value comes from every token of the sequence (the trainer computes it first: `sequence_log_ratio`)
and its gradient through each token (exp(sg[log s_i] + log ratio_t - sg[log ratio_t]), GSPO-token):
summed with the weights 1 / |T_i| below, that is the gradient of s_i itself.

Optional KL to a reference policy (the base model, adapter off, or a checkpoint the trainer
loads: TrainConfig.kl_reference_step), k3 estimator, with coefficient beta:

    d_t     = min(logp_ref_t - logp_new_t, 20)
    kl_t    = min(exp(d_t) - d_t - 1, 10)
    loss_t += beta * kl_t

k3 is unbiased on tokens the policy sampled, but one token the policy has made rare and the
reference finds likely gives exp(d_t) in the thousands, and its gradient then swamps the
step's after clipping: capped, as verl's low_var_kl caps it, such a token pulls no further.

The batch loss averages over assistant tokens, each weighted by w_t = 1 / (assistant tokens of
its trajectory), so every trajectory counts the same however long it is:

    loss = sum_t w_t * loss_t / sum_t w_t

The trainer passes weights already divided by the whole batch's sum_t w_t, so the loss of each
micro-batch is its share of the batch loss and the gradients simply accumulate.

SFT steps ("sft") take the token-mean cross-entropy of sft.py instead, through the same trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor


KL_LOG_RATIO_CAP = 20.0  # exp stays finite, so a capped token's gradient is 0, not 0 * inf
KL_TOKEN_CAP = 10.0


@dataclass(frozen=True)
class LossConfig:
    kind: Literal["cispo", "ppo", "sft"] = "cispo"
    epsilon: float = 1.0  # lower clip: 1 - epsilon (PPO's usual value is 0.2)
    epsilon_high: float = 4.0  # upper clip for CISPO: 1 + epsilon_high
    beta: float = 0.0  # KL coefficient
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"] = "token"


@dataclass
class LossTerms:
    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    clipped_fraction: Tensor


def token_log_ratio(logp_new: Tensor, logp_rollout: Tensor) -> Tensor:
    """log ratio_t; where the rollout logprob is unknown (NaN) the rollout policy is the current one: ratio 1."""
    return logp_new - torch.where(torch.isnan(logp_rollout), logp_new.detach(), logp_rollout)


def sequence_log_ratio(log_ratio: Tensor, sequence_ids: Tensor, trained: Tensor) -> Tensor:
    """log s_i at every token: the mean of log ratio_u over the trained tokens u of its sequence."""
    sums = torch.zeros(int(sequence_ids.max()) + 1, dtype=log_ratio.dtype, device=log_ratio.device)
    counts = torch.zeros_like(sums)
    sums.index_add_(0, sequence_ids, torch.where(trained, log_ratio, 0.0))
    counts.index_add_(0, sequence_ids, trained.to(log_ratio.dtype))
    return (sums / counts.clamp(min=1))[sequence_ids]


def importance_ratio(log_ratio: Tensor, level: str, sequence: Tensor | None) -> Tensor:
    """ratio_t at `level` ("token", or with `sequence`, log s_i at each token, one of the others)."""
    if level == "token":
        return torch.exp(log_ratio)
    assert sequence is not None, f"importance_sampling_level={level!r} needs each token's sequence ratio"
    log_s = sequence.detach() + log_ratio - log_ratio.detach()  # s_i's value, its gradient through token t
    if level == "sequence":
        return torch.exp(log_s)
    if level == "average":
        return (torch.exp(log_ratio) + torch.exp(log_s)) / 2
    return torch.exp((log_ratio + log_s) / 2)  # geometric_average


def policy_loss(logp_new: Tensor, logp_rollout: Tensor, advantages: Tensor, weights: Tensor,
                config: LossConfig, logp_ref: Tensor | None = None, sequence: Tensor | None = None) -> LossTerms:
    """All tensors are per token, same shape; `weights` is 0 wherever a token is not trained
    and sums to 1 over the whole batch. `sequence`: log s_i at each token (no gradient), for an
    importance_sampling_level other than "token"."""
    ratio = importance_ratio(token_log_ratio(logp_new, logp_rollout), config.importance_sampling_level, sequence)
    if config.kind == "cispo":
        clipped_ratio = ratio.clamp(1 - config.epsilon, 1 + config.epsilon_high).detach()
        per_token = -clipped_ratio * advantages * logp_new
        clipped = (ratio < 1 - config.epsilon) | (ratio > 1 + config.epsilon_high)
    else:
        clipped_ratio = ratio.clamp(1 - config.epsilon, 1 + config.epsilon)
        per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
        clipped = clipped_ratio != ratio

    kl = torch.zeros_like(per_token)
    if config.beta and logp_ref is not None:
        log_ratio_ref = (logp_ref - logp_new).clamp(max=KL_LOG_RATIO_CAP)
        kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1).clamp(max=KL_TOKEN_CAP)

    def mean(x: Tensor) -> Tensor:
        return (x * weights).sum()

    policy = mean(per_token)
    kl_mean = mean(kl)
    return LossTerms(policy + config.beta * kl_mean, policy.detach(), kl_mean.detach(),
                     mean(clipped.float()).detach())
