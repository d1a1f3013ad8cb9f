"""Schemathesis over the app's own /openapi.json: every route, in process (ASGI), with a fixed
number of examples per operation from a fixed seed, so the run is short and the same every time.

Every generated request must get no 5xx, a response that conforms to the schema where the schema
describes one, a 4xx when it breaks the schema, a 405 with `Allow` for a method a route does not
take, and must write nothing outside the art dir.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from schemathesis import Case, CheckContext, HookContext, Response
from schemathesis.checks import CheckFunction, not_a_server_error
from schemathesis.generation.meta import TestPhase
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    unsupported_method,
)

from art_backend.engine.torch_engine import TorchEngine
from art_backend.server import create_app
from art_backend.training.service import TrainingService

CHAT = "/v1/chat/completions"
REGISTER = "/v1/training/models"
# registered before the run, so that valid requests to a model's routes can reach the training service
PROJECT, MODEL = "fuzz", "fuzzed"
# A valid chat request may ask for the whole context (2048 tokens) for each of 128 choices: capped,
# so a call takes milliseconds. What is fuzzed is the request, not how long the model talks.
MAX_TOKENS, MAX_N = 4, 4
PLAIN = [{"role": "user", "content": "Hello"}]

CONFIG = schemathesis.Config.from_dict({
    "seed": 19,
    # `deterministic`: Hypothesis derandomized, so CI sends the same requests on every run; no
    # example database, so nothing from an earlier run (or another machine) changes them
    "generation": {"max-examples": 50, "deterministic": True, "database": "none"},
    # the only health check that depends on the machine's speed; shared CI machines are slow at times
    "suppress-health-check": ["too_slow"],
    # failures quote the request in full: by default a key with "token" in it reads "[Filtered]"
    "output": {"sanitization": {"enabled": False}},
})
# What the schema can back, the server is held to. Left out: status_code_conformance and
# positive_data_acceptance (the schema documents 200 and 422 only, and cannot state rules the
# server keeps: a served model, plain names, tool results answering a call, integer logit_bias
# keys; so requests valid by the schema get a 400, 404 or 422 by design), max_response_time
# (timing), and the checks with nothing to check here (no documented response headers, no
# security schemes, no links for a stateful run).
CHECKS: list[CheckFunction] = [not_a_server_error, response_schema_conformance, content_type_conformance,
                               negative_data_rejection, unsupported_method]


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model_dir: Path) -> Iterator[TorchEngine]:
    """An engine of the fuzz's own: the models it registers stay off the session's `tiny_engine`,
    whose tests expect to know every model it serves."""
    engine = TorchEngine(tiny_model_dir)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture
def art_dir(tmp_path: Path) -> Path:
    """Three levels below tmp_path: a name that climbs out (`../x`, `../../x`) lands where we look."""
    return tmp_path / "outer" / "inner" / "art"


def _outside(tmp_path: Path, art_dir: Path) -> set[str]:
    """Every path under tmp_path but the art dir's, and tmp_path's siblings."""
    seen = {str(entry) for entry in tmp_path.parent.iterdir()}
    for directory, subdirectories, files in os.walk(tmp_path):
        subdirectories[:] = [name for name in subdirectories if Path(directory, name) != art_dir]
        seen.update(os.path.join(directory, name) for name in subdirectories + files)
    return seen


def _nothing_written_outside(tmp_path: Path, art_dir: Path) -> CheckFunction:
    before = _outside(tmp_path, art_dir)

    def nothing_written_outside_the_art_dir(ctx: CheckContext, response: Response, case: Case) -> None:
        written = _outside(tmp_path, art_dir) - before
        assert not written, f"written outside the art dir {art_dir}: {sorted(written)}"

    return nothing_written_outside_the_art_dir


@pytest.fixture
def api(fuzz_engine: TorchEngine, art_dir: Path) -> schemathesis.BaseSchema:
    app = create_app(fuzz_engine, training=TrainingService(fuzz_engine, art_dir))
    with TestClient(app) as client:
        client.post(REGISTER, json={"project": PROJECT, "name": MODEL}).raise_for_status()
    served = fuzz_engine.served_models()
    vocabulary = len(fuzz_engine.tokenizer)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, config=CONFIG)

    # Random model names, names that are not plain names and project/model pairs no one registered
    # end at a 404 or a 422 before anything else is read, and so do random messages (a tool message
    # answering no call): valid requests are aimed, so they reach the engine and the training service.
    @schema.hook
    def map_case(context: HookContext, case: Case) -> Case:
        if not _positive(case):
            return case
        case = _bounded(case)
        # the coverage phase sends each boundary value once, in a case of its own: all are aimed
        if case.meta is not None and case.meta.phase.name == TestPhase.COVERAGE:
            return _aimed(case, _fixed_aim(case, served[0]))
        return case

    @schema.hook
    def flatmap_case(context: HookContext, case: Case) -> st.SearchStrategy[Case]:
        # (run in the fuzzing phase only) Hypothesis draws which valid requests are aimed
        if not _positive(case):
            return st.just(case)
        return st.one_of(_drawn_aim(case, served, vocabulary), st.just(case))

    return schema


def _positive(case: Case) -> bool:
    """Whether `case` is valid by the schema (a negative one must be refused as it was generated)."""
    return case.meta is not None and case.meta.generation.mode.is_positive


def _bounded(case: Case) -> Case:
    """A chat request that asks for few tokens and choices."""
    if case.operation.path != CHAT or not isinstance(case.body, dict):
        return case
    body = case.body
    limits = [key for key in ("max_tokens", "max_completion_tokens") if body.get(key) is not None]
    for key in limits:
        body[key] = min(body[key], MAX_TOKENS)
    if not limits:
        body["max_tokens"] = MAX_TOKENS
    body["n"] = min(body.get("n", 1), MAX_N)
    return case


def _answered(case: Case) -> list[Any]:
    """The generated messages but the tool messages: their call ids are random, so they answer no call."""
    messages = case.body.get("messages", []) if isinstance(case.body, dict) else []
    return [m for m in messages if not (isinstance(m, dict) and m.get("role") == "tool")]


def _aimed(case: Case, fields: dict[str, Any]) -> Case:
    """`case` with `fields` in its body (where it has an object body), about the registered model
    (where its path names one)."""
    aimed = case.derive()
    if isinstance(aimed.body, dict):
        aimed.body = {**aimed.body, **fields}
    if {"project", "name"} <= aimed.path_parameters.keys():
        aimed.path_parameters.update(project=PROJECT, name=MODEL)
    return aimed


def _fixed_aim(case: Case, model: str) -> dict[str, Any]:
    """The fields a case of the coverage phase is aimed with: a chat request to `model` with its
    messages but the tool messages (or plain ones), a registration under plain names."""
    if case.operation.path == CHAT:
        return {"model": model, "messages": _answered(case) or PLAIN}
    if case.operation.path == REGISTER:
        return {"project": PROJECT, "name": "covered"}
    return {}


def _drawn_aim(case: Case, served: list[str], vocabulary: int) -> st.SearchStrategy[Case]:
    """`case` aimed with drawn fields: a chat request to a served model, streamed or not, its
    messages kept or made plain, its `logit_bias` keyed by token ids (JSON keys are strings, so
    the schema cannot say they are integers), some outside the vocabulary; a registration under
    plain names."""
    if case.operation.path == CHAT:
        plain = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3)
        answered = _answered(case)
        bias = st.dictionaries(st.integers(-2, vocabulary + 2).map(str), st.floats(-100, 100), max_size=3)
        fields = st.fixed_dictionaries(
            {"model": st.sampled_from(served), "stream": st.booleans(),
             "messages": st.one_of(plain, st.just(answered)) if answered else plain},
            optional={"logit_bias": bias})
    elif case.operation.path == REGISTER:
        name = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
        fields = st.fixed_dictionaries({"project": name, "name": name})
    else:
        fields = st.just({})
    return fields.map(lambda drawn: _aimed(case, drawn))


schema = schemathesis.pytest.from_fixture("api")


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """Schemathesis 4.32's lazy schemas read and rename `node._nodeid`, which pytest 9.2 no longer
    has (its node ids are structured now): give it one to read."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@schema.parametrize()
def test_every_route_holds_under_generated_requests(case: Case, tmp_path: Path, art_dir: Path) -> None:
    case.call_and_validate(checks=CHECKS, additional_checks=[_nothing_written_outside(tmp_path, art_dir)])
