"""Shared fixtures: the embedded and tiny models, engines on them, and real HTTP servers.

The embedded model is converted from its GGUF once into the cache dir
(ART_BACKEND_CACHE_DIR, default ~/.cache/art-backend), so only the first run pays for it.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from art_backend.config import BackendSettings
from art_backend.engine.torch_engine import TorchEngine
from art_backend.model_store import embedded_model_dir as _embedded_model_dir
from art_backend.model_store import tiny_model_dir as _tiny_model_dir
from art_backend.server import create_app


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return BackendSettings().cache_dir


@pytest.fixture(scope="session")
def embedded_model_dir(cache_dir: Path) -> Path:
    return _embedded_model_dir(cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    return _tiny_model_dir(cache_dir)


def _close(engine: TorchEngine) -> None:
    asyncio.run(engine.close())


@pytest.fixture(scope="session")
def embedded_engine(embedded_model_dir: Path) -> Iterator[TorchEngine]:
    engine = TorchEngine(embedded_model_dir)
    yield engine
    _close(engine)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    engine = TorchEngine(tiny_model_dir)
    yield engine
    _close(engine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A real uvicorn server on a loopback port, in a background thread."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="session")
def server(embedded_engine: TorchEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(embedded_engine)) as running:
        yield running


@pytest.fixture(scope="session")
def tiny_server(tiny_engine: TorchEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(tiny_engine)) as running:
        yield running


REPO = Path(__file__).resolve().parent.parent


def run_example(module: str, *args: str, timeout: float = 900) -> str:
    """Run `python -m <module> args...` from the repository root; fail with its output if it fails."""
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout
