"""Fixtures of the newest-clients venv (`make test-clients`: the client package, the newest openai
SDK and HTTP clients, no torch): one `art-backend serve` on the tiny model, started from the
backend's venv (ART_CLIENTS_BACKEND_PYTHON, default .venv's python) as a process of its own, and
another OpenAI-compatible server (not a backend) on loopback, written here with the standard
library, that notes the headers of what it is sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny-random-smollm2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def backend_url() -> Iterator[str]:
    """`art-backend serve --model tiny-random-smollm2` on a free port, this checkout's code; its URL."""
    python = os.environ.get("ART_CLIENTS_BACKEND_PYTHON", str(REPO / ".venv" / "bin" / "python"))
    if not Path(python).exists():
        pytest.fail(f"no backend python at {python}: `make setup` (or set ART_CLIENTS_BACKEND_PYTHON)")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "backend")]),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.TemporaryDirectory() as art_dir, open(Path(art_dir) / "backend.log", "wb") as log:
        process = subprocess.Popen([python, "-m", "art_backend", "serve", "--model", MODEL, "--port", str(port),
                                    "--art-dir", art_dir, "--log-level", "warning"], env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300  # generous: a loaded machine imports torch slowly
            while True:  # polled: the backend is up when /health answers
                if process.poll() is not None:
                    pytest.fail(f"the backend exited ({process.returncode}): "
                                f"{(Path(art_dir) / 'backend.log').read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"the backend did not start: {(Path(art_dir) / 'backend.log').read_text()[-3000:]}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=60)


class OtherServer:
    """An OpenAI-compatible server that is not a backend (a hosted judge, say): each generation is a
    fixed reply, whole or streamed, without the backend's mark; `seen` has each request's headers."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet: a line per request otherwise
                return

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                seen.append({key.lower(): value for key, value in self.headers.items()})
                message = {"role": "assistant", "content": "fine"}
                if body.get("stream"):
                    chunks = [{"choices": [{"index": 0, "delta": message, "finish_reason": None}]},
                              {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}]
                    payload = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                    kind = "text/event-stream"
                else:
                    payload = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                                          "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
                    kind = "application/json"
                data = payload.encode()
                self.send_response(200)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)


@pytest.fixture(scope="session")
def other_server() -> Iterator[OtherServer]:
    server = OtherServer()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()
