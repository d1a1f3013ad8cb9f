"""`art-backend serve`: start the OpenAI-compatible backend."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

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


@app.command()
def serve(
    host: Annotated[Optional[str], typer.Option(help="Address to bind. Default 127.0.0.1.")] = None,
    port: Annotated[Optional[int], typer.Option(help="Port. Default 8000.")] = None,
    model: Annotated[Optional[str], typer.Option(
        help="Local Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="Name clients put in `model`.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        help="Require `Authorization: Bearer KEY` on every route (mandatory off loopback). "
             "Env: ART_BACKEND_API_KEY.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(help="Converted-model cache. Env: ART_BACKEND_CACHE_DIR.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Context limit in tokens.")] = None,
    art_dir: Annotated[Optional[Path], typer.Option(
        help="Where trained models live (default .art). Env: ART_BACKEND_ART_DIR.")] = None,
) -> None:
    """Serve the model on HTTP until interrupted."""
    overrides = {k: v for k, v in {
        "host": host, "port": port, "model": model, "served_model_name": served_model_name,
        "api_key": api_key, "cache_dir": cache_dir, "max_model_len": max_model_len,
        "art_dir": art_dir}.items() if v is not None}
    settings = BackendSettings(**overrides)
    if not is_loopback(settings.host) and not settings.api_key:
        raise typer.BadParameter(
            f"Binding {settings.host} exposes the backend beyond this machine: pass --api-key "
            "(or set ART_BACKEND_API_KEY), or bind 127.0.0.1.", param_hint="--host")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from art_backend.app import build_app

    uvicorn.run(build_app(settings), host=settings.host, port=settings.port, log_level="info")
