"""Models named by hub id: served from a hub cache laid out on disk (offline), downloaded from a
fake hub on loopback (HF_ENDPOINT), every failure one clear error; a LocalBackend given no model
starts on the first TrainableModel's base model, and refuses a model naming another.

Nothing here reaches the network: every run sets HF_ENDPOINT to loopback or HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from art_backend.model_store import (EMBEDDED_HUB_ID, EMBEDDED_MODEL_NAME, ModelNotFoundError, resolve_model_dir,
                                     served_names)

from art_integrations import Model, TrainableModel
from art_integrations.backend import BackendError, LocalBackend
from art_integrations.wire import free_loopback_port
from tests.conftest import REPO, ServerThread, checkout_env
from tests.fake_hub import FakeHub, HubRepo, commit_id, fake_hub_app, model_files, write_hub_cache

MAIN, V2 = commit_id("main"), commit_id("v2")
ART_BASE_MODEL = "meta-llama/Meta-Llama-3.1-8B-Instruct"  # the tiny model, under the id ART's examples use
# the same weights in formats the backend does not read, and folders it does not load: never downloaded
NOT_NEEDED = {"pytorch_model.bin": b"pickle", "model.gguf": b"gguf", "onnx/model.onnx": b"onnx",
              "original/consolidated.00.pth": b"pth", "README.md": b"# tiny"}
NEEDED = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja"}


@pytest.fixture(scope="module")
def tiny_files(tiny_model_dir: Path) -> dict[str, bytes]:
    files = model_files(tiny_model_dir)
    assert set(files) == NEEDED  # what the snapshot checks below expect
    return files


def _with_context(files: dict[str, bytes], positions: int) -> dict[str, bytes]:
    """The same model with another context length: a revision that /v1/models tells apart."""
    config = json.loads(files["config.json"])
    return {**files, "config.json": json.dumps({**config, "max_position_embeddings": positions}).encode()}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory, tiny_files: dict[str, bytes]) -> Path:
    cache = tmp_path_factory.mktemp("hub") / "hub"
    write_hub_cache(cache, "org/tiny", {MAIN: tiny_files, V2: _with_context(tiny_files, 1024)},
                    {"main": MAIN, "v2": V2})
    write_hub_cache(cache, ART_BASE_MODEL, {MAIN: tiny_files}, {"main": MAIN})
    return cache


@pytest.fixture
def offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's environment (which LocalBackend children inherit) set to the on-disk hub, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    return hub_cache


@pytest.fixture(scope="module")
def fake_hub(tiny_files: dict[str, bytes]) -> Iterator[tuple[FakeHub, str]]:
    hub = FakeHub({
        "org/tiny": HubRepo({**tiny_files, **NOT_NEEDED}, MAIN),
        "org/gated": HubRepo(tiny_files, MAIN, gated=True),
        "org/bin-only": HubRepo({"config.json": tiny_files["config.json"], "pytorch_model.bin": b"pickle"}, MAIN),
    })
    with ServerThread(fake_hub_app(hub)) as running:
        yield hub, running.base_url


def _env(**changes: str) -> dict[str, str]:
    """This environment for a child that imports this checkout's packages, without HF_HUB_OFFLINE."""
    env = checkout_env(**changes)
    if "HF_HUB_OFFLINE" not in changes:
        env.pop("HF_HUB_OFFLINE", None)
    return env


async def _served(backend: LocalBackend) -> list[dict[str, object]]:
    return (await backend.request("GET", "/v1/models"))["data"]


# ----- serving a hub id ---------------------------------------------------------------------------

async def test_a_hub_id_is_served_from_the_hub_cache_offline_under_its_id(offline: Path, tmp_path: Path) -> None:
    async with LocalBackend(in_process=False, model="org/tiny", art_dir=tmp_path) as backend:  # serve --model org/tiny
        listed = await _served(backend)
        assert [m["id"] for m in listed] == ["org/tiny", "tiny"]  # the repo's own name stays an alias
        assert {m["root"] for m in listed} == {"org/tiny"} and listed[0]["max_model_len"] == 2048
        client = backend.openai_client()
        for name in ("org/tiny", "tiny"):
            reply = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, seed=0,
                extra_body={"return_token_ids": True})
            assert reply.model == name and len(reply.choices[0].model_extra["token_ids"]) >= 1


async def test_a_revision_serves_that_snapshot(offline: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_BACKEND_REVISION", "v2")  # the v2 snapshot's config has a 1024-token context
    async with LocalBackend(in_process=False, model="org/tiny", art_dir=tmp_path) as backend:
        (first, _) = await _served(backend)
        assert first["id"] == "org/tiny" and first["max_model_len"] == 1024


def test_a_hub_model_downloads_only_the_files_it_needs_with_progress(
        fake_hub: tuple[FakeHub, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub, endpoint = fake_hub
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    log = tmp_path / "backend.log"
    backend = LocalBackend(in_process=False, model="org/tiny", art_dir=tmp_path / "art", log_file=log)
    try:
        served = httpx.get(f"{backend.base_url}/v1/models").json()["data"]
        assert served[0]["id"] == "org/tiny"
    finally:
        backend.stop()
    assert sorted(hub.downloaded) == sorted(f"org/tiny/{name}" for name in NEEDED)
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / MAIN
    assert {p.name for p in snapshot.iterdir()} == NEEDED
    assert f"Fetching {len(NEEDED)} files" in log.read_text()  # huggingface_hub's progress bar


# ----- every failure: one error naming the model and the fix ----------------------------------------

_RESOLVE = """import sys
from pathlib import Path
from art_backend.model_store import ModelNotFoundError, resolve_model_dir
try:
    print(resolve_model_dir(sys.argv[1], Path(sys.argv[2]), sys.argv[3] or None))
except ModelNotFoundError as error:
    print(error)
    sys.exit(2)
"""


@pytest.mark.parametrize(("model", "revision", "hub", "expected"), [
    ("org/missing", "", "fake", ["No hub model 'org/missing' at http://127.0.0.1:", "check the id's spelling",
                                 "HF_TOKEN", "./org/missing"]),
    ("org/gated", "", "fake", ["'org/gated' is gated", "http://127.0.0.1:", "/org/gated", "HF_TOKEN"]),
    ("org/tiny", "v9", "fake", ["'org/tiny' has no revision 'v9'", "--revision", "ART_BACKEND_REVISION"]),
    ("org/bin-only", "", "fake", ["no safetensors weights"]),
    ("org/too/deep", "", "fake", ["'org/too/deep' is neither a local directory nor a hub id"]),
    ("org/tiny", "", "offline", ["'org/tiny' is not in the hub cache", "HF_HUB_OFFLINE=1 forbids",
                                 "hf download org/tiny"]),
    ("org/tiny", "v2", "unreachable", ["'org/tiny' at revision 'v2' is not in the hub cache", "could not be reached",
                                       "Connection refused", "hf download org/tiny --revision v2"]),
], ids=["missing", "gated", "no-revision", "bin-only", "not-an-id", "offline-not-cached", "hub-unreachable"])
def test_hub_failures_are_one_error_naming_the_model_and_the_fix(
        model: str, revision: str, hub: str, expected: list[str], fake_hub: tuple[FakeHub, str],
        tmp_path: Path) -> None:
    env = _env(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=fake_hub[1])
    if hub == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    elif hub == "unreachable":
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_loopback_port()}"  # nothing listens there
    result = subprocess.run([sys.executable, "-c", _RESOLVE, model, str(tmp_path / "art-cache"), revision],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    for fragment in expected:
        assert fragment in result.stdout, result.stdout


def test_serve_names_a_hub_failure_in_one_line_without_a_traceback(fake_hub: tuple[FakeHub, str],
                                                                   tmp_path: Path) -> None:
    env = _env(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=fake_hub[1])
    result = subprocess.run([sys.executable, "-m", "art_backend", "serve", "--model", "org/tiny", "--revision", "v9",
                             "--port", str(free_loopback_port())], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Error: The hub model 'org/tiny' has no revision 'v9'" in result.stderr
    assert "Traceback" not in result.stderr


def test_paths_stay_directories_and_a_revision_needs_a_hub_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face model directory"):
        resolve_model_dir("./no-such-model", tmp_path)  # looks like a path: the hub is not asked
    with pytest.raises(ModelNotFoundError, match="picks a version of a hub model"):
        resolve_model_dir(str(tiny_model_dir), tmp_path, revision="v2")


# ----- LocalBackend() without a model, as ART users write it ------------------------------------------

async def test_a_local_backend_without_a_model_starts_on_the_first_trainable_models_base(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    async with LocalBackend(art_dir=tmp_path) as backend:
        async with httpx.AsyncClient() as probe:
            with pytest.raises(httpx.ConnectError):  # nothing started yet
                await probe.get(f"{backend.base_url}/health")
        model = TrainableModel(name="m", project="p", base_model=str(tiny_model_dir))
        await model.register(backend)
        served = [m["id"] for m in await _served(backend)]
        assert served[:2] == [tiny_model_dir.name, str(tiny_model_dir)] and model.base_model == tiny_model_dir.name

        other = TrainableModel(name="other", project="p", base_model="Qwen/Qwen3-8B")
        with pytest.raises(BackendError, match=r"\(409\): Model 'other' names base model 'Qwen/Qwen3-8B', but this "
                                               r"backend serves 'tiny-random-smollm2'.*Start another backend"):
            await other.register(backend)
        assert [m["id"] for m in await _served(backend)] == served  # nothing loaded
        assert not (tmp_path / "p" / "models" / "other").exists()
        # any name of the served base registers
        await TrainableModel(name="again", project="p", base_model=tiny_model_dir.name).register(backend)


async def test_a_scored_model_registered_first_starts_a_lazy_backend_on_the_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    async with LocalBackend(art_dir=tmp_path) as backend:
        await Model(name="prompted", project="p").register(backend)
        assert [m["id"] for m in await _served(backend)] == [EMBEDDED_MODEL_NAME, EMBEDDED_HUB_ID]


async def test_the_embedded_model_answers_to_both_its_names_from_a_cold_backend_offline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenPipe's tic-tac-toe example names its base model so; with no hub cache and no network the
    packaged copy is served under the name registered first, and under the other as an alias."""
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    async with LocalBackend(art_dir=tmp_path) as backend:  # started by the first register, on its base model
        first = TrainableModel(name="by-hub-id", project="names", base_model=EMBEDDED_HUB_ID)
        await first.register(backend)
        second = TrainableModel(name="by-name", project="names", base_model=EMBEDDED_MODEL_NAME)
        await second.register(backend)
        assert first.base_model == second.base_model == EMBEDDED_MODEL_NAME
        client = first.openai_client()
        for name in (EMBEDDED_HUB_ID, EMBEDDED_MODEL_NAME):
            reply = await client.chat.completions.create(model=name, max_tokens=2,
                                                         messages=[{"role": "user", "content": "Hi"}])
            assert reply.choices[0].finish_reason in ("stop", "length")


def test_the_embedded_model_s_names_resolve_to_the_packaged_copy_unless_the_hub_cache_holds_it(
        hub_cache: Path, tiny_files: dict[str, bytes], cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    packaged = cache_dir / "models" / EMBEDDED_MODEL_NAME
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))  # holds org/tiny, not SmolLM2 (read at import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for name in (None, EMBEDDED_MODEL_NAME, EMBEDDED_HUB_ID):
        assert resolve_model_dir(name, cache_dir) == packaged
    assert served_names(EMBEDDED_HUB_ID, packaged) == [EMBEDDED_MODEL_NAME, EMBEDDED_HUB_ID]
    with pytest.raises(ModelNotFoundError, match="is not one.*pass a hub id"):
        resolve_model_dir(EMBEDDED_MODEL_NAME, cache_dir, revision="v2")
    write_hub_cache(hub_cache, EMBEDDED_HUB_ID, {MAIN: tiny_files}, {"main": MAIN})  # the hub's own copy, cached
    snapshot = resolve_model_dir(EMBEDDED_HUB_ID, cache_dir)
    assert snapshot.name == MAIN and snapshot.parent.parent.name == "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    assert served_names(EMBEDDED_HUB_ID, snapshot) == [EMBEDDED_HUB_ID, EMBEDDED_MODEL_NAME]
    assert resolve_model_dir(EMBEDDED_MODEL_NAME, cache_dir) == packaged  # the short name stays the packaged one


def test_an_art_script_trains_a_hub_base_model_on_a_backend_given_no_model(offline: Path, tmp_path: Path) -> None:
    """ART's own pattern: `backend = LocalBackend()`, `TrainableModel(base_model="meta-llama/...")`,
    `await model.register(backend)`, a step trained (tests/art_scripts/single_turn.py, imports changed only)."""
    env = _env(BASE_MODEL=ART_BASE_MODEL, HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, str(REPO / "tests" / "art_scripts" / "single_turn.py")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "trained step 1" in run.stdout
    trained = tmp_path / ".art" / "art-port" / "models" / "single-001"
    assert json.loads((trained / "model.json").read_text())["base_model"] == ART_BASE_MODEL
    history = [json.loads(line) for line in (trained / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if h["split"] == "train"] == [1]
