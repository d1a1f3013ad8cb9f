"""Assemble the served application from settings: model directory -> engine -> HTTP app."""

from __future__ import annotations

from fastapi import FastAPI

from art_backend.config import BackendSettings
from art_backend.engine.torch_engine import TorchEngine
from art_backend.model_store import resolve_model_dir
from art_backend.server import create_app
from art_backend.training.service import TrainingService


def build_engine(settings: BackendSettings) -> TorchEngine:
    model_dir = resolve_model_dir(settings.model, settings.cache_dir)
    return TorchEngine(model_dir, served_model_name=settings.served_model_name,
                       max_model_len=settings.max_model_len, max_batch_size=settings.max_batch_size,
                       threads=settings.threads, dtype=settings.dtype,
                       cpu_kernels=settings.cpu_kernels)


def build_app(settings: BackendSettings) -> FastAPI:
    engine = build_engine(settings)
    return create_app(engine, api_key=settings.api_key, close_engine_on_shutdown=True,
                      training=TrainingService(engine, settings.art_dir))
