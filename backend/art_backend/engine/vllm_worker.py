"""What the backend adds to each vLLM worker process, through vLLM's `worker_extension_cls`:
vLLM mixes the class below into its worker class, and `VLLMEngine` calls these methods on every
worker (one per GPU; on CPU the engine core's) with `collective_rpc` once vLLM has started."""

from __future__ import annotations

import logging

from art_backend.engine import vllm_cpu_lora, vllm_policy_logprobs

logger = logging.getLogger(__name__)

WORKER_EXTENSION = f"{__name__}.BackendWorker"


class BackendWorker:
    def report_policy_logprobs(self) -> bool:
        """Logprobs the policy's own at the request's temperature (`vllm_policy_logprobs.py`)."""
        installed = vllm_policy_logprobs.install()
        if not installed:
            logger.warning("This vLLM's sampler is not the one art_backend knows: logprobs stay vLLM's (after "
                           "penalties and top-k/top-p; 0.0 for a token a grammar forces), so GRPO's importance ratio "
                           "differs from 1 for the policy that sampled and trains forced tokens less on this engine.")
        return installed

    def group_cpu_lora_ops(self, grouped: bool = True) -> bool:
        """vLLM's CPU LoRA ops as one matmul per adapter (`vllm_cpu_lora.py`); False on a GPU."""
        return vllm_cpu_lora.install(grouped)
