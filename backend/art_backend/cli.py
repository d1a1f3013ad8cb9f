"""`art-backend serve`: start the OpenAI-compatible backend; `art-backend view`: browse what it stored."""

from __future__ import annotations

import ipaddress
import json
import logging
from pathlib import Path
from typing import Annotated, Any, Optional
from urllib.parse import quote

import typer
from pydantic import ValidationError

from art_backend.config import BackendSettings

app = typer.Typer(help="art-backend: serve (and train) a policy behind an OpenAI-compatible API.",
                  no_args_is_help=True, add_completion=False)


@app.callback()
def main() -> None:
    """art-backend: serve (and train) a policy behind an OpenAI-compatible API."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_key_off_loopback(host: str, api_key: str | None, what: str) -> None:
    if not is_loopback(host) and not api_key:
        raise typer.BadParameter(
            f"Binding {host} exposes the {what} beyond this machine: pass --api-key "
            "(or set ART_BACKEND_API_KEY), or bind 127.0.0.1.", param_hint="--host")


def _json_object(text: str | None, option: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise typer.BadParameter(f"not JSON ({error}): pass an object such as '{{\"enforce_eager\": true}}'",
                                 param_hint=option) from None
    if not isinstance(value, dict):
        raise typer.BadParameter("pass a JSON object of argument names and values", param_hint=option)
    return value


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="Address to bind. Default 127.0.0.1.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port. Default 8000.")] = None,
    log_level: Annotated[Optional[str], typer.Option(
        help="debug, info (default: a line per request too) or warning (only what needs attention). "
             "Env: ART_BACKEND_LOG_LEVEL.")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="Hugging Face hub id (e.g. Qwen/Qwen2.5-7B-Instruct; from the hub cache, else downloaded) or local "
             "model directory (default: the embedded SmolLM2-135M-Instruct). Env: ART_BACKEND_MODEL.")] = None,
    revision: Annotated[Optional[str], typer.Option(
        help="With a hub id: branch, tag or commit (default main). Env: ART_BACKEND_REVISION.")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Name clients put in `model`.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require `Authorization: Bearer KEY` on every route (mandatory off loopback). "
             "Env: ART_BACKEND_API_KEY.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(help="Converted-model cache. Env: ART_BACKEND_CACHE_DIR.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context limit in tokens.")] = None,
    art_dir: Annotated[Optional[Path], typer.Option(
        help="Where trained models live (default .art). Env: ART_BACKEND_ART_DIR.")] = None,
    dtype: Annotated[Optional[str], typer.Option(
        help="CPU: float32 (default) or bfloat16, the serving forward's weights and matmuls (bfloat16: ~1.2x "
             "faster on AVX512-BF16/AMX CPUs, sampled logprobs ~0.03 nats off the fp32 trainer's). "
             "Env: ART_BACKEND_DTYPE.")] = None,
    max_request_bytes: Annotated[Optional[int], typer.Option(
        help="The largest request body taken (default 64 MiB); larger: 413. Env: ART_BACKEND_MAX_REQUEST_BYTES.")] = None,
    engine: Annotated[Optional[str], typer.Option(
        help="auto (default: vLLM where a CUDA GPU and vLLM are present, else torch), torch or vllm. "
             "Env: ART_BACKEND_ENGINE.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(
        help="vLLM: fraction of GPU memory for weights and KV cache.")] = None,
    kv_cache_memory_bytes: Annotated[Optional[int], typer.Option(
        help="vLLM: bytes of KV cache (default on CPU: 1 GiB).")] = None,
    max_loras: Annotated[Optional[int], typer.Option(help="vLLM: adapters in one batch (default 4).")] = None,
    max_cpu_loras: Annotated[Optional[int], typer.Option(help="vLLM: adapters kept loaded.")] = None,
    max_lora_rank: Annotated[Optional[int], typer.Option(help="vLLM: highest LoRA rank served (default 16).")] = None,
    tensor_parallel_size: Annotated[Optional[int], typer.Option(help="vLLM: GPUs per model.")] = None,
    data_parallel_size: Annotated[Optional[int], typer.Option(
        help="vLLM: copies of the model, each on its own GPUs, requests balanced across them.")] = None,
    vllm_engine_args: Annotated[Optional[str], typer.Option(
        help='vLLM: further AsyncEngineArgs as JSON, e.g. \'{"enforce_eager": true}\'.')] = None,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        help="Tool-call markup, as vLLM names it: hermes, llama3_json or mistral (default: read from the chat "
             "template). Env: ART_BACKEND_TOOL_CALL_PARSER.")] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option(
        help="Reasoning markup, as vLLM names it: qwen3 or deepseek_r1 (default: read from the chat template). "
             "Env: ART_BACKEND_REASONING_PARSER.")] = None,
    checkpoint_store: Annotated[Optional[str], typer.Option(
        help="fsspec URL (s3://bucket/prefix, file:///shared/path): every step and logged score is pushed there "
             "before it is acknowledged, and a registering model pulls what is missing here first (a node that may "
             "vanish). Env: ART_BACKEND_CHECKPOINT_STORE.")] = None,
    checkpoint_store_options: Annotated[Optional[str], typer.Option(
        help="fsspec storage options for --checkpoint-store, as JSON.")] = None,
    exit_with_parent: Annotated[bool, typer.Option(
        help="Stop when the process that started this one exits, killed or not (LocalBackend starts its "
             "server so).")] = False,
) -> None:
    """Serve the model on HTTP until interrupted."""
    if dtype not in (None, "float32", "bfloat16"):
        raise typer.BadParameter(f"{dtype!r}: use float32 or bfloat16", param_hint="--dtype")
    if engine not in (None, "auto", "torch", "vllm"):
        raise typer.BadParameter(f"{engine!r}: use auto, torch or vllm", param_hint="--engine")
    overrides = {k: v for k, v in {
        "host": host, "port": port, "log_level": log_level, "model": model, "revision": revision, "served_model_name": served_model_name,
        "api_key": api_key, "cache_dir": cache_dir, "max_model_len": max_model_len,
        "art_dir": art_dir, "dtype": dtype, "max_request_bytes": max_request_bytes, "engine": engine, "gpu_memory_utilization": gpu_memory_utilization,
        "kv_cache_memory_bytes": kv_cache_memory_bytes, "max_loras": max_loras, "max_cpu_loras": max_cpu_loras,
        "max_lora_rank": max_lora_rank, "tensor_parallel_size": tensor_parallel_size,
        "data_parallel_size": data_parallel_size, "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser, "checkpoint_store": checkpoint_store,
        "checkpoint_store_options": _json_object(checkpoint_store_options, "--checkpoint-store-options"),
        "vllm_engine_args": _json_object(vllm_engine_args, "--vllm-engine-args")}.items() if v is not None}
    try:
        settings = BackendSettings(**overrides)
    except ValidationError as error:
        raise typer.BadParameter(str(error)) from None
    require_key_off_loopback(settings.host, settings.api_key, "backend")
    if settings.tune_process_memory is None:  # this process is the backend's own
        settings.tune_process_memory = True
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if exit_with_parent:  # before the model loads, which can take minutes
        from art_backend.parent_watch import exit_with_parent as watch_parent

        watch_parent()

    import uvicorn

    from art_backend.app import build_app
    from art_backend.errors import ModelNotFoundError

    try:
        application = build_app(settings)
    except ModelNotFoundError as error:  # the message names the model and the fix: no traceback to read through
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(2) from None
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=settings.log_level)


@app.command()
def view(
    art_dir: Annotated[Optional[Path], typer.Option(
        help="The art dir the backend wrote (default .art). Env: ART_BACKEND_ART_DIR.")] = None,
    project: Annotated[Optional[str], typer.Option(
        help="Open this project's page (with --name: that model's).")] = None,
    name: Annotated[Optional[str], typer.Option(help="Open this trained model's page (needs --project).")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="The base model directory the backend served, for the token view's tokenizer "
             "(default: found from the stored base model's name; the embedded and tiny models are known). "
             "Env: ART_BACKEND_MODEL.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(
        help="Converted-model cache. Env: ART_BACKEND_CACHE_DIR.")] = None,
    # Explicit defaults, not ART_BACKEND_HOST/PORT: those configure `serve`, and the viewer runs beside it.
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8001,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require the key on every page (mandatory off loopback): open the page once with ?key=KEY. "
             "Env: ART_BACKEND_API_KEY.")] = None,
) -> None:
    """Serve a read-only web page over the stored trajectories: reward curves, steps, groups,
    conversations and the trained tokens."""
    overrides = {k: v for k, v in {"art_dir": art_dir, "model": model, "cache_dir": cache_dir,
                                   "api_key": api_key}.items() if v is not None}
    try:
        settings = BackendSettings(**overrides)
    except ValidationError as error:
        raise typer.BadParameter(str(error)) from None
    require_key_off_loopback(host, settings.api_key, "viewer")
    from art_backend.viewer import Tokenizers, create_viewer_app
    from art_backend.viewer.store import ArtStore, NotInStore

    if not settings.art_dir.is_dir():
        raise typer.BadParameter(f"{settings.art_dir.resolve()} does not exist: pass the --art-dir the backend "
                                 "wrote to (`art-backend serve --art-dir`, `LocalBackend(art_dir=...)`).",
                                 param_hint="--art-dir")
    store = ArtStore(settings.art_dir)
    if name is not None and project is None:
        raise typer.BadParameter("--name needs --project: model names are per project.", param_hint="--name")
    path = ""
    try:
        if project is not None:
            store.model_names(project)
            path = f"/{project}"
        if name is not None and project is not None:
            store.model(project, name)
            path += f"/{name}"
    except NotInStore as error:
        raise typer.BadParameter(str(error), param_hint="--name" if error.what == "model" else "--project") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    shown_host = f"[{host}]" if ":" in host else host
    typer.echo(f"Viewing {settings.art_dir.resolve()} at http://{shown_host}:{port}{quote(path)}"
               + ("?key=KEY" if settings.api_key else ""))
    app = create_viewer_app(settings.art_dir, Tokenizers(settings.cache_dir, settings.model), settings.api_key)
    uvicorn.run(app, host=host, port=port, log_level="warning")


@app.command("export")
def export_command(
    target: Annotated[str, typer.Argument(
        metavar="PROJECT/NAME[@STEP]", help="The trained model and its step (default: the newest).")],
    format_: Annotated[str, typer.Option(
        "--format", help="adapter (peft's layout, for vLLM --lora-modules and peft), merged (safetensors, for "
                         "transformers and vLLM) or gguf (llama.cpp's converter, with an Ollama Modelfile).")],
    out: Annotated[Path, typer.Option(help="The folder to write: new, or empty.")],
    quant: Annotated[Optional[str], typer.Option(
        help="gguf: f16 (default), bf16, f32 or q8_0 (llama.cpp's converter), or a type llama-quantize makes, "
             "e.g. q4_k_m (it is built once from llama.cpp's sources).")] = None,
    modelfile: Annotated[bool, typer.Option(help="gguf: write an Ollama Modelfile beside the GGUF.")] = True,
    art_dir: Annotated[Optional[Path], typer.Option(
        help="Where the backend wrote the model (default .art). Env: ART_BACKEND_ART_DIR.")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="The base model the backend served, as `serve --model` took it (default: found from the stored base "
             "model's name; needed for a local directory). Env: ART_BACKEND_MODEL.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(
        help="Converted-model and llama.cpp cache. Env: ART_BACKEND_CACHE_DIR.")] = None,
) -> None:
    """Export a trained step for vLLM, transformers, llama.cpp or Ollama (no backend needs to run)."""
    from art_backend.export import ExportError, build, plan, stored_model
    from art_backend.training.routes import checked_name

    overrides = {k: v for k, v in {"art_dir": art_dir, "model": model, "cache_dir": cache_dir}.items() if v is not None}
    try:
        settings = BackendSettings(**overrides)
    except ValidationError as error:
        raise typer.BadParameter(str(error)) from None
    named, _, step_text = target.partition("@")
    project, _, name = named.partition("/")
    try:
        checked_name(project)
        checked_name(name)
        step = int(step_text) if step_text else None
    except ValueError as error:
        raise typer.BadParameter(f"{target!r}: name the model as PROJECT/NAME or PROJECT/NAME@STEP ({error})",
                                 param_hint="PROJECT/NAME[@STEP]") from None
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        trained, base = stored_model(settings.art_dir, project, name, settings.cache_dir, settings.model)
        planned = plan(trained, step, format_, out, base, settings.cache_dir, quant=quant, modelfile=modelfile)
        build(planned, progress=typer.echo)
    except ExportError as error:
        typer.echo(f"Error: {error}", err=True)
        raise typer.Exit(2) from None
