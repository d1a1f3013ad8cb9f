"""The GRPO policy loss, top to bottom.

For every token t the policy produced in a rollout:

    ratio_t = exp(logp_new_t - logp_rollout_t)          importance weight vs the rollout policy
    A_t     = advantage of the token's trajectory        (r - mean(r_group)) / (std(r_group) + 1e-6)
                                                          (or r - mean(r_group): scale_rewards=False)

CISPO (default), a clipped-importance-weight REINFORCE:

    loss_t = -clip(ratio_t, 1 - eps, 1 + eps_high).detach() * A_t * logp_new_t

PPO-clip (option):

    loss_t = -min(ratio_t * A_t, clip(ratio_t, 1 - eps, 1 + eps) * A_t)

Optional KL to the base policy (adapter off), k3 estimator, with coefficient beta:

    kl_t    = exp(logp_ref_t - logp_new_t) - (logp_ref_t - logp_new_t) - 1
    loss_t += beta * kl_t

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


@dataclass(frozen=True)
class LossConfig:
    kind: Literal["cispo", "ppo", "sft"] = "cispo"
    epsilon: float = 1.0  # lower clip: 1 - epsilon (PPO's usual value is 0.2)
    epsilon_high: float = 4.0  # upper clip for CISPO: 1 + epsilon_high
    beta: float = 0.0  # KL coefficient


@dataclass
class LossTerms:
    loss: Tensor
    policy_loss: Tensor
    kl: Tensor
    clipped_fraction: Tensor


def policy_loss(logp_new: Tensor, logp_rollout: Tensor, advantages: Tensor, weights: Tensor,
                config: LossConfig, logp_ref: Tensor | None = None) -> LossTerms:
    """All tensors are per token, same shape; `weights` is 0 wherever a token is not trained
    and sums to 1 over the whole batch."""
    # Where the rollout logprob is unknown (NaN) the rollout policy is the current one: ratio 1.
    logp_rollout = torch.where(torch.isnan(logp_rollout), logp_new.detach(), logp_rollout)
    ratio = torch.exp(logp_new - logp_rollout)
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
        log_ratio_ref = logp_ref - logp_new
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1

    def mean(x: Tensor) -> Tensor:
        return (x * weights).sum()

    policy = mean(per_token)
    kl_mean = mean(kl)
    return LossTerms(policy + config.beta * kl_mean, policy.detach(), kl_mean.detach(),
                     mean(clipped.float()).detach())
