"""Assemble the served application from settings: model directory -> engine -> HTTP app."""

from __future__ import annotations

import importlib.util
import logging

from fastapi import FastAPI

from art_backend.config import BackendSettings
from art_backend.engine.base import Engine
from art_backend.model_store import resolve_model_dir, served_names
from art_backend.server import create_app
from art_backend.training.mirror import StoreMirror
from art_backend.training.service import OneTrainer, TrainingService

logger = logging.getLogger(__name__)


def choose_engine(requested: str) -> tuple[str, str]:
    """The engine to serve with, and why."""
    if requested != "auto":
        return requested, "asked for"
    import torch

    if not torch.cuda.is_available():
        return "torch", "auto: no CUDA GPU"
    if importlib.util.find_spec("vllm") is None:
        return "torch", "auto: CUDA GPU but vLLM is not installed (pip install 'art-backend[vllm]')"
    return "vllm", "auto: CUDA GPU and vLLM"


# settings that one engine reads and the other does not
_TORCH_ONLY = {"threads", "cpu_kernels", "prefix_cache_bytes", "prefix_cache_idle_seconds"}
_VLLM_ONLY = {"gpu_memory_utilization", "kv_cache_memory_bytes", "max_loras", "max_cpu_loras", "max_lora_rank",
              "tensor_parallel_size", "data_parallel_size", "vllm_engine_args"}


def build_engine(settings: BackendSettings, trainer: OneTrainer | None = None) -> Engine:
    """The engine the settings ask for; `trainer`: the training service's, which vLLM on a GPU loads
    first (its copy of the weights must fit beside vLLM's)."""
    # one directory for everything that loads the model (vLLM, the trainer, the tokenizer): a hub
    # id's snapshot is resolved once here, so they cannot load different revisions
    model_dir = resolve_model_dir(settings.model, settings.cache_dir, settings.revision)
    names = served_names(settings.model, model_dir)
    name, aliases = settings.served_model_name or names[0], names
    engine, reason = choose_engine(settings.engine)
    logger.info("Engine: %s (%s)", engine, reason)
    unused = sorted(settings.model_fields_set & (_TORCH_ONLY if engine == "vllm" else _VLLM_ONLY))
    if unused:
        logger.warning("Not read by the %s engine, so without effect: %s (ART_BACKEND_%s)", engine,
                       ", ".join(unused), ", ART_BACKEND_".join(name.upper() for name in unused))
    if engine == "vllm":
        from art_backend.engine.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, served_model_name=name, aliases=aliases,
                          max_model_len=settings.max_model_len, dtype=settings.dtype,
                          max_batch_size=settings.max_batch_size,
                          gpu_memory_utilization=settings.gpu_memory_utilization,
                          kv_cache_memory_bytes=settings.kv_cache_memory_bytes, max_loras=settings.max_loras,
                          max_cpu_loras=settings.max_cpu_loras, max_lora_rank=settings.max_lora_rank,
                          tensor_parallel_size=settings.tensor_parallel_size,
                          data_parallel_size=settings.data_parallel_size, engine_args=settings.vllm_engine_args,
                          tune_process_memory=bool(settings.tune_process_memory), load_trainer_first=trainer)
    from art_backend.engine.torch_engine import TorchEngine

    return TorchEngine(model_dir, served_model_name=name, aliases=aliases,
                       max_model_len=settings.max_model_len, max_batch_size=settings.max_batch_size or 64,
                       prefix_cache_bytes=settings.prefix_cache_bytes,
                       prefix_cache_idle_seconds=settings.prefix_cache_idle_seconds, threads=settings.threads,
                       dtype=settings.dtype, cpu_kernels=settings.cpu_kernels,
                       tune_process_memory=bool(settings.tune_process_memory))


def build_app(settings: BackendSettings) -> FastAPI:
    trainer = OneTrainer()
    mirror = (StoreMirror(settings.checkpoint_store, settings.checkpoint_store_options)
              if settings.checkpoint_store else None)
    engine = build_engine(settings, trainer)
    return create_app(engine, api_key=settings.api_key, close_engine_on_shutdown=True,
                      training=TrainingService(engine, settings.art_dir, settings.cache_dir, trainer, mirror),
                      max_request_bytes=settings.max_request_bytes,
                      token_records_bytes=settings.token_records_bytes, continuations_bytes=settings.continuations_bytes,
                      tool_call_parser=settings.tool_call_parser, reasoning_parser=settings.reasoning_parser)
