"""vLLM's logprobs made the policy's own, as the torch engine reports them (`sampling.py`).

The trainer's importance ratio compares its recompute of each token's logprob,
log_softmax(logits / T), with the one the rollout reported. vLLM has no logprobs mode that
measures that distribution: `raw_logprobs` are at temperature 1, `processed_logprobs` come after
penalties, logit bias and the top-k/top-p cuts, and both after a grammar's mask (applied in the
model runner before the sampler runs), so a token the grammar forces gets logprob 0.0 whatever
the model thought of it. The ratio then differs from 1 for the policy that sampled, e.g.

    ratio_t = exp(logp_new_t - 0.0)     exp(-6) for a forced `<tool_call>` the model does not yet favour

and CISPO weighs that token by it, so a grammar's forced tokens (the tool-call format) hardly train.

So in each vLLM worker:
  - the grammar's mask moves from just before the sampler to the start of `Sampler.sample`:
    penalties, logit bias and bad words are applied first (each acts on single tokens, so the
    order does not change what is sampled), then the mask, and vLLM samples as before;
  - `Sampler.forward` takes, before all of that, each row's logprobs at its temperature

        logp_t = log_softmax(logits_t / T)          (T = 1 for greedy rows)

    and reports those for the sampled token and the top logprobs, in place of vLLM's.

What is sampled is untouched. Installed in every worker process through `vllm_worker.py`.
"""

from __future__ import annotations

from typing import Any

import torch

_GREEDY = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


class _DeferredMask:
    """The grammar mask of the current step, held from the model runner until the sampler."""

    def __init__(self) -> None:
        self.pending: tuple[Any, ...] | None = None


_deferred = _DeferredMask()


def policy_logprobs(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """[rows, vocab] logprobs at each row's temperature (`temperature` None: every row greedy)."""
    if temperature is None:
        return torch.log_softmax(logits.float(), dim=-1)
    scale = temperature.float()
    scale = torch.where(scale < _GREEDY, torch.ones_like(scale), scale)
    return torch.log_softmax(logits.float() / scale[:, None], dim=-1)


def install() -> bool:
    """Patch this process's vLLM; False where its internals are not the ones this was written for."""
    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.worker import gpu_model_runner

    apply_mask = getattr(gpu_model_runner, "apply_grammar_bitmask", None)
    sample = getattr(sampler_module.Sampler, "sample", None)
    forward = getattr(sampler_module.Sampler, "forward", None)
    gather = getattr(sampler_module.Sampler, "gather_logprobs", None)
    if apply_mask is None or sample is None or forward is None or gather is None:
        return False
    if getattr(apply_mask, "_art_deferred", False):
        return True

    def defer_mask(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: torch.Tensor) -> None:
        if scheduler_output.scheduled_spec_decode_tokens:  # speculative rows are laid out differently
            apply_mask(scheduler_output, grammar_output, input_batch, logits)
            return
        _deferred.pending = (scheduler_output, grammar_output, input_batch)

    def sample_after_mask(self: Any, logits: torch.Tensor, sampling_metadata: Any,
                          *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        pending, _deferred.pending = _deferred.pending, None
        if pending is not None:
            apply_mask(*pending, logits)
        return sample(self, logits, sampling_metadata, *args, **kwargs)

    def forward_with_policy_logprobs(self: Any, logits: torch.Tensor, sampling_metadata: Any,
                                     predict_bonus_token: bool = False, *args: Any, **kwargs: Any) -> Any:
        wanted = sampling_metadata.max_num_logprobs
        if wanted is None or wanted < 0 or predict_bonus_token or sampling_metadata.logprob_token_ids:
            return forward(self, logits, sampling_metadata, predict_bonus_token, *args, **kwargs)
        # before the sampler changes `logits` in place (penalties, bias, the mask, temperature, cuts)
        policy = policy_logprobs(logits, sampling_metadata.temperature)
        output = forward(self, logits, sampling_metadata, predict_bonus_token, *args, **kwargs)
        output.logprobs_tensors = gather(policy, wanted, token_ids=output.sampled_token_ids[:, 0].long())
        return output

    defer_mask._art_deferred = True  # type: ignore[attr-defined]
    gpu_model_runner.apply_grammar_bitmask = defer_mask
    sampler_module.Sampler.sample = sample_after_mask
    sampler_module.Sampler.forward = forward_with_policy_logprobs
    return True
