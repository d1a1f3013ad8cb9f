"""vLLM's logprobs under a grammar, made the policy's own, as the torch engine reports them.

vLLM masks a grammar's disallowed tokens in the logits before its sampler runs, so even its
`processed_logprobs` are taken among the tokens the grammar allowed: a token the grammar forces
gets logprob 0.0 whatever the model thought of it. GRPO's importance ratio then compares the
trainer's logprob with a number the policy never produced,

    ratio_t = exp(logp_new_t - 0.0)     e.g. exp(-6) for a forced `<tool_call>` the model does not yet favour

and CISPO weighs that token by it, so a grammar's forced tokens (the tool-call format) hardly
train. No vLLM setting gives logprobs before the mask (raw_* modes are taken after it too).

So in each vLLM worker, the mask moves from just before the sampler to the start of
`Sampler.sample`: penalties, logit bias and bad words are applied first (each acts on single
tokens, so the order does not change what is sampled), the rows under a grammar keep a copy of
their logits there, the mask is applied and vLLM samples as before. Those rows' logprobs are then
replaced by the policy's own at the request's temperature, before mask and top-k/top-p cuts:

    logp_t = log_softmax(logits_t / T)[token_t]     (T = 1 for greedy rows)

which is what `sampling.py` reports for a constrained row on the torch engine. Rows without a
grammar, and what is sampled, are untouched.

Installed in every worker process through `vllm_worker.py`.
"""

from __future__ import annotations

from typing import Any

import torch


class _DeferredMask:
    """The grammar mask of the current step, held from the model runner until the sampler."""

    def __init__(self) -> None:
        self.pending: tuple[Any, ...] | None = None


_deferred = _DeferredMask()


def install() -> bool:
    """Patch this process's vLLM; False where its internals are not the ones this was written for."""
    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.worker import gpu_model_runner

    apply_mask = getattr(gpu_model_runner, "apply_grammar_bitmask", None)
    sample = getattr(sampler_module.Sampler, "sample", None)
    if apply_mask is None or sample is None:
        return False
    if getattr(apply_mask, "_art_deferred", False):
        return True

    def defer_mask(scheduler_output: Any, grammar_output: Any, input_batch: Any, logits: torch.Tensor) -> None:
        if scheduler_output.scheduled_spec_decode_tokens:  # speculative rows are laid out differently
            apply_mask(scheduler_output, grammar_output, input_batch, logits)
            return
        _deferred.pending = (scheduler_output, grammar_output, input_batch)

    def sample_with_policy_logprobs(self: Any, logits: torch.Tensor, sampling_metadata: Any,
                                    *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        pending, _deferred.pending = _deferred.pending, None
        if pending is None:
            return sample(self, logits, sampling_metadata, *args, **kwargs)
        scheduler_output, grammar_output, input_batch = pending
        wanted = set(grammar_output.structured_output_request_ids)
        rows = [i for i, request_id in enumerate(input_batch.req_ids[: logits.shape[0]]) if request_id in wanted]
        policy = logits[rows].clone() if rows and sampling_metadata.max_num_logprobs is not None else None
        apply_mask(scheduler_output, grammar_output, input_batch, logits)
        sampled, logprobs = sample(self, logits, sampling_metadata, *args, **kwargs)
        if policy is None or logprobs is None or self.logprobs_mode != "processed_logprobs":
            return sampled, logprobs
        index = torch.tensor(rows, device=logits.device)
        temperature = sampling_metadata.temperature
        if temperature is None:  # every row greedy
            scale = torch.ones(len(rows), device=logits.device)
        else:
            scale = temperature[index].float()
            scale = torch.where(scale < 1e-5, torch.ones_like(scale), scale)
        logprobs[index] = torch.log_softmax(policy.float() / scale[:, None], dim=-1)
        return sampled, logprobs

    defer_mask._art_deferred = True  # type: ignore[attr-defined]
    gpu_model_runner.apply_grammar_bitmask = defer_mask
    sampler_module.Sampler.sample = sample_with_policy_logprobs
    return True

