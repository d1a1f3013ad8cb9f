"""Backend settings, read from `ART_BACKEND_*` environment variables or the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "art-backend"


class BackendSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ART_BACKEND_", extra="ignore")

    model: str | None = Field(
        default=None,
        description="A local Hugging Face model directory. Unset: the embedded SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients use in `model`. Default: the model directory's name."
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted models (safetensors) are cached.",
    )
    art_dir: Path = Field(
        default=Path(".art"), description="Where trained models live: <art_dir>/<project>/models/<name>/."
    )
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = Field(
        default=None, description="Required on every route when set; mandatory off loopback."
    )
    max_model_len: int | None = Field(
        default=None, description="Context limit in tokens. Default: the model's own, at most 8192."
    )
    max_batch_size: int = Field(default=64, description="Sequences decoded together in one step.")
    threads: int | None = Field(default=None, description="torch CPU threads. Default: all cores.")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="CPU: the serving forward's weights and matmuls. bfloat16 is ~1.2x faster "
        "on CPUs with AVX512-BF16 or AMX for weights that are not exact integer groups (the embedded model's are, "
        "and are as fast in float32); sampled logprobs then differ from the fp32 trainer's by ~0.03 nats on "
        "average. The trainer stays in float32. On GPU the model's bfloat16 is always used.")
    cpu_kernels: bool = Field(
        default=True, description="CPU: decode with fused C++ kernels (~1.25x faster steps), built once per "
        "machine (~20 s, needs a C++ compiler). false: plain torch ops only.")
