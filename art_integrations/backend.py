"""Backends reached over HTTP: a remote one by URL, or a local one this process starts.

Both speak the same API: OpenAI-compatible inference under /v1 and training under
/v1/training, so user code does not change between a laptop and a GPU server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import httpx
from openai import AsyncOpenAI

from art_integrations.art_compat import names
from art_integrations.art_compat.config import settings_environment, settings_variables, train_config_with
from art_integrations.capture.transports.core import known_backend
from art_integrations.checkpoint_sync import CheckpointSync
from art_integrations.training import TrainConfig, TrainResult
from art_integrations.wire import free_loopback_port

if TYPE_CHECKING:
    from art_integrations.trajectory import TrajectoryGroup


ENGINES = ("auto", "torch", "vllm")
logger = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """The backend refused or failed a request; the message is the backend's own."""


@runtime_checkable
class TrainsOnBackend(Protocol):
    """What `Backend.train` asks of a model: a `TrainableModel`'s (model.py, which imports this module)."""

    name: str
    _backend: Backend | None

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | None = None) -> TrainResult: ...


class Backend(CheckpointSync):
    """A backend at `base_url` (without the /v1 suffix). Its checkpoint sync to object storage
    (`push_checkpoints`, ART's `_experimental_push_to_s3`, ...) is in `checkpoint_sync.py`."""

    ART_METHODS: ClassVar[dict[str, str]] = names.BACKEND_METHODS

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float | None = None) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        known_backend(self.base_url)  # its replies' logprobs are asked for from the first call on
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # a training step can take minutes on CPU: no read timeout unless asked
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers,
                                       timeout=httpx.Timeout(timeout, connect=10.0))
        self._openai_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncOpenAI] = \
            weakref.WeakKeyDictionary()

    def __getattr__(self, name: str) -> Any:
        names.refuse_art_name(type(self).__name__, name, type(self).ART_METHODS, "method")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` at the backend: without `kwargs`, one per event loop, kept (as ART's
        `model.openai_client()` keeps one). A client made per call and dropped unclosed leaves its
        connections to the garbage collector, and rollouts sent meanwhile on a newer client waited
        for replies the server never got: tests/test_grpo_learns.py's rounds, each on a client of
        its own, hung until openai's 600 s timeout in most runs."""
        def new() -> AsyncOpenAI:
            return AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "unused", **kwargs)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet: it cannot be known which one the client will live on
            loop = None
        if kwargs or loop is None:
            return new()
        client = self._openai_clients.get(loop)
        if client is None or client.is_closed():
            client = self._openai_clients[loop] = new()
        return client

    def __reduce__(self) -> tuple[type[RemoteBackend], tuple[str, str | None, float | None]]:
        # Pickled (a rollout sent to a Ray worker), any backend arrives as a client of the same
        # server: its connections, and a LocalBackend's server, stay with the process that made them.
        return RemoteBackend, (self.base_url, self.api_key, self._http.timeout.read)

    async def _ensure_started(self, model: str | None) -> None:
        """Make sure the server runs, on `model` if it has to start (a LocalBackend started lazily);
        a backend reached by URL runs already."""

    async def request(self, method: str, path: str, json: Any = None) -> Any:
        await self._ensure_started(None)
        try:
            response = await self._http.request(method, path, json=json)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise BackendError(f"Cannot reach the backend at {self.base_url}: {error!r}. Is it running?") from error
        except httpx.TransportError as error:
            raise BackendError(
                f"{method} {path}: the backend at {self.base_url} took the request but the connection broke before "
                f"an answer ({error!r}): it may have stopped or failed; its log says which. Whether the request took "
                "effect is unknown (after a restart, `await model.get_step()` tells for a train step).") from error
        if response.is_error:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise BackendError(f"{method} {path} failed ({response.status_code}): {message}")
        return response.json()

    async def train(self, model: TrainsOnBackend, groups: list[TrajectoryGroup], *, config: TrainConfig | None = None,
                    **settings: Any) -> TrainResult:
        """ART's current call style: `await backend.train(model, groups, learning_rate=1e-5)`, the
        same step as `model.train(groups, TrainConfig(...))`; each setting is a TrainConfig field
        (one it does not know is refused by name)."""
        if not isinstance(model, TrainsOnBackend):
            raise TypeError(f"backend.train trains a TrainableModel, not {type(model).__name__}")
        if config is not None and settings:
            raise TypeError("pass the settings as config=TrainConfig(...) or as keywords, not both")
        if model._backend is not self:
            raise RuntimeError(f"Model {model.name!r} is not registered with this backend: "
                               "call `await model.register(backend)` first.")
        ours = {key: value for key, value in settings.items() if key in TrainConfig.model_fields}
        arts = {key: value for key, value in settings.items() if key not in ours}  # ART's names (loss_fn, ...)
        config = config or TrainConfig(**ours)
        return await model.train(groups, train_config_with(config, arts, "backend.train()") if arts else config)

    def take_engine_settings(self, settings: dict[str, Any], source: str) -> None:
        """Engine settings a model asks for (ART's `_internal_config`). A running backend keeps the
        ones it started with: say which were asked for and how to start it with them."""
        logger.warning("%s asks for backend settings %s; the backend at %s is running and keeps its own. To apply "
                       "them, start it with %s (`art-backend serve --help` lists them).", source, settings,
                       self.base_url, settings_variables(settings))

    async def close(self) -> None:
        await self._http.aclose()
        client = self._openai_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()

    async def __aenter__(self) -> Backend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class RemoteBackend(Backend):
    """A backend started elsewhere (`art-backend serve --host ... --api-key ...`)."""


def _stop_at_exit(backend: LocalBackend) -> None:
    """Stop `backend` when the interpreter exits, if nothing stopped it before: a script that ends
    without close() (its backend object maybe long collected) must not leave the engine mid-step
    on a daemon thread while Python finalizes (its next torch call then aborts the process), nor a
    child server running on after it. threading's exit hook, not atexit's: atexit runs after
    concurrent.futures has shut down every executor, and the server's shutdown waits on them."""
    threading._register_atexit(backend.stop)  # type: ignore[attr-defined]  # private, but in every Python since 3.9


class LocalBackend(Backend):
    """Starts the bundled backend on loopback, as a process of its own (`art-backend serve`), or
    with `in_process=True` as a server thread in this process. Stopped by `close()` or leaving
    `async with`, else when the interpreter exits.

    Its own process is the default because the engine tunes the process it runs in for good (torch's
    CPU allocator, glibc's malloc settings: the `tune_process_memory` setting) and a crash in its
    kernels would take your script down with it; in this process it leaves both as they are unless
    ART_BACKEND_TUNE_PROCESS_MEMORY=true.

    `model`: a Hugging Face hub id (e.g. "Qwen/Qwen2.5-7B-Instruct", from the hub cache, else
    downloaded) or a local model directory; the server starts now. Without it (and without
    `ART_BACKEND_MODEL`) the server starts at first use, as in ART: the first `TrainableModel`
    registered starts it on its `base_model` (the embedded SmolLM2-135M-Instruct if that is None);
    any other request before that (a scored-only `Model` registered, `openai_client()`) starts it
    on the embedded model. One backend serves one base model: a model naming another is refused.
    `engine`: "torch", "vllm" or "auto" (the default, or `ART_BACKEND_ENGINE`: vLLM where a CUDA GPU
    and vLLM are present, else the embedded torch engine).
    `art_dir` (ART's `path`): where checkpoints, metrics and trajectories are written (default `.art`).
    `log_file`: where the backend's own process writes its log (default: this process's output,
    warnings and errors only). Every other backend setting is read from its `ART_BACKEND_*`
    environment variable.
    """

    def __init__(self, *, in_process: bool = False, model: str | None = None, engine: str | None = None,
                 art_dir: str | Path = ".art", port: int | None = None, startup_timeout: float = 600.0,
                 log_file: str | Path | None = None, path: str | Path | None = None) -> None:
        if engine not in (None, *ENGINES):
            raise ValueError(f"engine={engine!r}: use one of {', '.join(map(repr, ENGINES))}.")
        if path is not None:  # ART's name for the art dir
            if art_dir != ".art" and Path(art_dir) != Path(path):
                raise ValueError(f"art_dir={str(art_dir)!r} and path={str(path)!r} name the same thing: pass one")
            art_dir = path
        port = port or free_loopback_port()
        super().__init__(f"http://127.0.0.1:{port}")
        self._process: subprocess.Popen[bytes] | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._port, self._in_process, self._engine, self._art_dir = port, in_process, engine, Path(art_dir)
        self._log_file, self._startup_timeout = log_file, startup_timeout
        self._start_lock = threading.Lock()
        self._started = False
        self._engine_settings: dict[str, Any] = {}  # asked for by a model's _internal_config before the start
        if model is not None or os.environ.get("ART_BACKEND_MODEL"):
            self._start(model)

    async def _ensure_started(self, model: str | None) -> None:
        if not self._started:  # starting loads (maybe downloads) a model: off the event loop
            await asyncio.to_thread(self._start, model)

    def _start(self, model: str | None) -> None:
        """Start the server on `model` (None: the setting's or the embedded default), once."""
        with self._start_lock:
            if self._started:
                return
            if self._in_process:
                self._start_in_process(self._port, model, self._engine, self._art_dir)
            else:
                self._start_child(self._port, model, self._engine, self._art_dir, self._log_file)
            _stop_at_exit(self)
            self._wait_until_up(self._startup_timeout)
            self._started = True

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        self._start(None)
        return super().openai_client(**kwargs)

    def take_engine_settings(self, settings: dict[str, Any], source: str) -> None:
        """Before the server starts (the lazy start, on the first registered model), its settings
        are applied at the start; after, it keeps its own (see Backend.take_engine_settings)."""
        with self._start_lock:
            if not self._started:
                self._engine_settings.update(settings)
                logger.info("%s: the backend will start with %s", source, settings)
                return
        super().take_engine_settings(settings, source)

    def _start_in_process(self, port: int, model: str | None, engine: str | None, art_dir: Path) -> None:
        try:  # the optional art-backend package (the client installs without it), so imported here
            import uvicorn

            from art_backend.app import build_app
            from art_backend.config import BackendSettings
        except ImportError as error:
            raise BackendError(
                f"LocalBackend needs the art-backend package ({error}): install it with "
                "`pip install -e ./backend` (or `make setup`), or connect to a running one with RemoteBackend(url)."
            ) from error
        chosen = {k: v for k, v in {"model": model, "engine": engine}.items() if v is not None}
        settings = BackendSettings(port=port, art_dir=art_dir, **chosen, **self._engine_settings)
        config = uvicorn.Config(build_app(settings), host="127.0.0.1", port=port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="art-local-backend", daemon=True)
        self._thread.start()

    def _start_child(self, port: int, model: str | None, engine: str | None, art_dir: Path,
                     log_file: str | Path | None) -> None:
        if importlib.util.find_spec("art_backend") is None:
            raise BackendError(
                f"LocalBackend starts the art-backend package, which {sys.executable} lacks: install it with "
                "`pip install -e ./backend` (or `make setup`), or connect to a running one with RemoteBackend(url).")
        command = [sys.executable, "-m", "art_backend", "serve", "--port", str(port), "--art-dir", str(art_dir),
                   "--exit-with-parent"]  # a script killed without running its exit hooks leaves no server behind
        if log_file is None:  # its log shares this process's output: what needs attention only
            command += ["--log-level", "warning"]
        if model:
            command += ["--model", model]
        if engine:
            command += ["--engine", engine]
        log = open(log_file, "ab") if log_file is not None else None  # noqa: SIM115 - the child owns it
        asked = settings_environment(self._engine_settings)
        self._process = subprocess.Popen(command, env={**os.environ, **asked, "PYTHONUNBUFFERED": "1"}, stdout=log,
                                         stderr=subprocess.STDOUT if log else None)
        if log is not None:
            log.close()  # the child has its own handle

    def _wait_until_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise BackendError(f"The backend process exited with code {self._process.returncode}; see its log above.")
            if self._thread is not None and not self._thread.is_alive():
                raise BackendError("The in-process backend stopped while starting; see the log above.")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise BackendError(f"The local backend did not start within {timeout:.0f} s.")

    @property
    def pid(self) -> int | None:
        """The server process's id when it runs in a process of its own (`in_process=False`) and has
        started, else None: for watching its memory or CPU from outside."""
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        """Stop the server (what `close()` does besides closing this client's connections)."""
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=60)
            self._server = self._thread = None
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None

    async def close(self) -> None:
        await super().close()
        self.stop()
