"""Backend settings, read from `ART_BACKEND_*` environment variables or the command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# The torch engine's store of finished turns' KV. The main job needs about 0.3 GB at once (12 rollouts'
# last turns of SmolLM2, 46 KB a token in fp32); at 1 GiB it held stale adapters' turns and the job
# peaked 0.74 GB higher, with the same scores and no faster (docs/benchmarks.md, Memory).
PREFIX_CACHE_BYTES = 256 << 20
# ...and how long it outlives the last request: a laptop gets that memory back once serving stops,
# while a rollout's next turn (after a tool call, a reward, a training step) still finds it.
PREFIX_CACHE_IDLE_SECONDS = 30.0


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "art-backend"


class BackendSettings(BaseSettings):
    # an empty variable (`ART_BACKEND_CACHE_DIR=`, a shell's way to clear one) means the default: read as
    # a path, "" is the current directory, and the model cache would land wherever the script runs
    model_config = SettingsConfigDict(env_prefix="ART_BACKEND_", extra="forbid", env_ignore_empty=True)

    @model_validator(mode="before")
    @classmethod
    def _known_settings_only(cls, data: Any) -> Any:
        """A misspelt setting, as an argument or an ART_BACKEND_* variable, is refused by name
        (pydantic-settings would ignore such a variable)."""
        unknown = sorted(set(data) - set(cls.model_fields)) if isinstance(data, dict) else []
        unknown += sorted(key for key in os.environ if key.upper().startswith("ART_BACKEND_")
                          and key[len("ART_BACKEND_"):].lower() not in cls.model_fields)
        if unknown:
            raise ValueError(f"Not backend settings: {', '.join(unknown)}. The settings are: "
                             f"{', '.join(cls.model_fields)} (as ART_BACKEND_<NAME> variables too; "
                             "`art-backend serve --help`).")
        return data

    model: str | None = Field(
        default=None,
        description="A Hugging Face hub id (e.g. Qwen/Qwen2.5-7B-Instruct: from the hub cache, else downloaded; "
        "HF_HOME, HF_HUB_CACHE, HF_TOKEN and HF_HUB_OFFLINE apply) or a local model directory (a path: starts with "
        "/, . or ~, or exists). Unset: the embedded SmolLM2-135M-Instruct.",
    )
    revision: str | None = Field(
        default=None, description="With a hub id: the branch, tag or commit to serve. Default: main.",
    )
    served_model_name: str | None = Field(
        default=None, description="Name clients use in `model`. Default: the hub id, else the model directory's name "
        "(the model as typed and its directory's or hub repo's name are accepted too)."
    )
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted models (safetensors) are cached.",
    )
    art_dir: Path = Field(
        default=Path(".art"), description="Where trained models live: <art_dir>/<project>/models/<name>/."
    )
    checkpoint_store: str | None = Field(
        default=None, description="An fsspec URL (s3://bucket/prefix, gs://bucket/prefix, file:///shared/path): "
        "every committed step and logged score is pushed there before the request is answered, and a model "
        "registering first pulls what the art dir lacks from there. For a backend on a node that may vanish "
        "(RayBackend). The credentials are this machine's (for s3:// its AWS_* variables or its role).")
    checkpoint_store_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options for checkpoint_store, as JSON "
        '(e.g. {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}).')
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="What the server logs: info includes a line per request; warning only what "
        "needs attention (a LocalBackend's own process, when it shares your script's output).")
    api_key: str | None = Field(
        default=None, description="Required on every route when set; mandatory off loopback."
    )
    max_model_len: int | None = Field(
        default=None, description="Context limit in tokens. Default: the model's own, at most 8192."
    )
    engine: Literal["auto", "torch", "vllm"] = Field(
        default="auto", description="What serves the model: the embedded torch engine, or vLLM. auto: vLLM where "
        "a CUDA GPU and vLLM are both present, else torch.")
    max_batch_size: int | None = Field(
        default=None, ge=1, description="Sequences decoded together in one step. Default: 64 on the torch engine, "
        "vLLM's own on vLLM (its max_num_seqs).")
    threads: int | None = Field(default=None, description="torch engine: CPU threads. Default: all cores.")
    prefix_cache_bytes: int = Field(
        default=PREFIX_CACHE_BYTES, ge=0, description="torch engine: memory for the KV of finished turns kept for "
        "reuse by the next turn or the group's other rollouts (least recently used out).")
    prefix_cache_idle_seconds: float = Field(
        default=PREFIX_CACHE_IDLE_SECONDS, ge=0, description="torch engine: after this many seconds with no request, "
        "the kept KV of finished turns is dropped and its memory returned (inf: kept until pushed out).")
    max_request_bytes: int = Field(
        default=64 << 20, ge=1024, description="The largest request body taken (a training step's groups included); "
        "larger ones are refused with a 413.")
    token_records_bytes: int = Field(
        default=256 << 20, ge=0, description="Memory for the exact tokens of recent replies kept for callback "
        "handlers to fetch (`return_token_ids`; least recently added out).")
    continuations_bytes: int = Field(
        default=16 << 20, ge=0, description="Memory for the text and ids of recent turns, so a prompt that replays "
        "one keeps its exact ids (token-in continuation; least recently used out).")
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="CPU: the serving forward's weights and matmuls. bfloat16 is ~1.2x faster "
        "on CPUs with AVX512-BF16 or AMX for weights that are not exact integer groups (the embedded model's are, "
        "and are as fast in float32); sampled logprobs then differ from the fp32 trainer's by ~0.03 nats on "
        "average. The trainer stays in float32. On GPU the model's bfloat16 is always used.")
    tune_process_memory: bool | None = Field(
        default=None, description="CPU: fix glibc's mmap threshold (freed tensors go back to the system, so the "
        "process gives each training step's peak back) and, with the fused kernels, swap torch's CPU allocator for "
        "one that reuses a training step's and a prefill's freed blocks (a step of the main job ~1.6x faster). Both "
        "change the whole process, for good. Unset: on in a process the backend owns (`art-backend serve`, a "
        "LocalBackend's own process), off when it runs inside another program's (LocalBackend(in_process=True), "
        "create_app), which keeps its allocator unless this is true.")
    cpu_kernels: bool = Field(
        default=True, description="CPU: decode with fused C++ kernels (~1.25x faster steps), built once per "
        "machine (~20 s, needs a C++ compiler). false: plain torch ops only.")

    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = Field(
        default=None, description="The model family's tool-call markup, by vLLM's --tool-call-parser name. Default: "
        "read from the chat template (Hermes <tool_call> for Qwen and templates without tools, JSON for Llama 3.x, "
        "[TOOL_CALLS] for Mistral).")
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        default=None, description="The family's reasoning markup (<think>...</think>, returned as "
        "reasoning_content), by vLLM's --reasoning-parser name. Default: read from the chat template.")

    # ----- the vLLM engine (vLLM's own names) -------------------------------------------
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="vLLM: the fraction of GPU memory it may take (weights and KV cache). "
        "Default: what is free once the trainer's copy of the weights is on the GPU, less 5 points, at most 0.9; "
        "on CPU the KV cache is sized by kv_cache_memory_bytes instead.")
    kv_cache_memory_bytes: int | None = Field(
        default=None, gt=0, description="vLLM: bytes of KV cache. Default on CPU 1 GiB (vLLM would reserve 92% of "
        "the machine's memory); on a GPU sized from gpu_memory_utilization.")
    max_loras: int = Field(default=4, ge=1, description="vLLM: adapters (checkpoints) decoded in one batch.")
    max_cpu_loras: int | None = Field(
        default=None, ge=1, description="vLLM: adapters kept loaded (least recently used out; others are read "
        "again from their checkpoint on demand). Default: max_loras.")
    max_lora_rank: int = Field(
        default=16, description="vLLM: the highest LoRA rank it serves (one of 1, 8, 16, 32, 64, 128, 256, 320, 512); "
        "registering a model with a higher rank is refused.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: GPUs that each layer is split across.")
    data_parallel_size: int = Field(
        default=1, ge=1, description="vLLM: copies of the model (each on tensor_parallel_size GPUs of its own) that "
        "requests are balanced across; adapters, pauses and sleep reach every copy.")
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM: further vllm.AsyncEngineArgs fields, as JSON "
        '(e.g. {"enforce_eager": true}); they win over the settings above.')
