"""Hostile and unlucky input, as outside testers sent it: every case gets a 4xx naming the field
and the fix, nothing is written outside the art dir, one request never fails another, and what
a model writes comes back exactly as written."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from art_backend.chat_format import ChatFormatter
from art_backend.engine.base import TokenLogprob
from art_backend.server import create_app
from art_backend.token_records import TokenRecords
from art_backend.training.service import TrainingService
from tests.conftest import ServerThread

TINY = "tiny-random-smollm2"
USER = [{"role": "user", "content": "x"}]


@pytest.fixture(scope="module")
def art_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "inside" / ".art"


@pytest.fixture(scope="module")
def running(tiny_engine: Any, art_dir: Path) -> Iterator[ServerThread]:
    app = create_app(tiny_engine, api_key="k3y", training=TrainingService(tiny_engine, art_dir),
                     max_request_bytes=1 << 20)
    with ServerThread(app) as server:
        yield server


@pytest.fixture(scope="module")
def http(running: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=running.base_url, headers={"Authorization": "Bearer k3y"}, timeout=120) as client:
        yield client


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": TINY, "messages": USER, "max_tokens": 2, **body})


@pytest.mark.parametrize(("body", "says"), [
    ({"project": "../x", "name": "m"}, "'../x' is not a name here"),
    ({"project": "p", "name": "/abs/path"}, "'/abs/path' is not a name here"),
    ({"project": "p", "name": "a\x00b"}, "is not a name here"),
    ({"project": "p", "name": "n" * 101}, "at most 100 characters"),
    ({"project": ".hidden", "name": "m"}, "starting with a letter or digit"),
])
def test_names_that_are_not_plain_names_are_refused(http: httpx.Client, art_dir: Path, body: dict, says: str) -> None:
    response = http.post("/v1/training/models", json=body)
    assert response.status_code == 422 and says in response.json()["error"]["message"]
    assert not art_dir.parent.parent.joinpath("x").exists() and not Path("/abs/path").exists()


def test_a_split_or_path_name_cannot_leave_the_art_dir(http: httpx.Client, art_dir: Path) -> None:
    assert http.post("/v1/training/models", json={"project": "p", "name": "m"}).status_code == 200
    logged = http.post("/v1/training/models/p/m/log", json={"groups": [], "split": "/abs/split"})
    assert logged.status_code == 422 and "not a name here" in logged.json()["error"]["message"]
    assert http.get("/v1/training/models/p/..%2F..%2Fm/step").status_code in (404, 422)
    written = {str(p.relative_to(art_dir.parent.parent)) for p in art_dir.parent.parent.rglob("*")}
    assert all(name.startswith("inside") for name in written), written


def test_a_seed_beyond_64_bits_is_refused_and_its_neighbours_are_unharmed(http: httpx.Client) -> None:
    refused = chat(http, seed=2**80)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "seed"
    assert chat(http, seed=2**63 - 1, n=2, temperature=1.0).status_code == 200

    async def many() -> list[int]:
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=dict(http.headers), timeout=120) as client:
            bodies = [{"seed": 2**64 - 1, "n": 2}] + [{"seed": i} for i in range(9)]
            responses = await asyncio.gather(*(client.post("/v1/chat/completions", json={
                "model": TINY, "messages": USER, "max_tokens": 4, "temperature": 1.0, **b}) for b in bodies))
            return [r.status_code for r in responses]

    assert asyncio.run(many()) == [422] + [200] * 9


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ({"model": "m\ud800"}, "model"),
    ({"tools": [{"type": "function", "function": {"name": "f\udfff"}}]}, "tools.0.function.name"),
])
def test_an_unpaired_surrogate_is_refused_naming_where(http: httpx.Client, body: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", content=json.dumps(
        {"model": TINY, "messages": USER, **body}).encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert f"{param} holds an unpaired UTF-16 surrogate" in response.json()["error"]["message"]


@pytest.mark.parametrize(("body", "says"), [
    ({"stop": ""}, "empty string"),
    ({"stop": ["x", ""]}, "empty string"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "distinct, non-empty function names"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "distinct, non-empty function names"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "must be a JSON schema of type object"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "nope", "content": "r"}]}, "which no earlier assistant"),
])
def test_requests_that_cannot_mean_anything_are_refused(http: httpx.Client, body: dict, says: str) -> None:
    response = chat(http, **body)
    assert response.status_code == 422 and says in response.json()["error"]["message"]


def test_a_body_that_is_too_large_or_not_json_is_refused(http: httpx.Client) -> None:
    large = chat(http, messages=[{"role": "user", "content": "x" * (2 << 20)}])
    assert large.status_code == 413 and "--max-request-bytes" in large.json()["error"]["message"]
    garbled = http.post("/v1/chat/completions", content=b'{"model": "\xff\xfe"}',
                        headers={"content-type": "application/json"})
    assert garbled.status_code == 422 and "not JSON" in garbled.json()["error"]["message"]


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(tiny_engine: Any) -> None:
    with ServerThread(create_app(tiny_engine, max_request_bytes=64 << 20)) as server:
        response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
            "model": TINY, "messages": [{"role": "user", "content": "word " * 4_000_000}]})
        assert response.status_code == 400 and "characters" in response.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(running: ServerThread) -> None:
    for header, status in (("bearer k3y", 200), ("BEARER k3y", 200), ("Bearer K3Y", 401), ("Basic k3y", 401)):
        assert httpx.get(f"{running.base_url}/v1/models", headers={"Authorization": header}).status_code == status


def test_token_ids_outside_the_vocabulary_are_refused_by_the_trainer(http: httpx.Client) -> None:
    http.post("/v1/training/models", json={"project": "p", "name": "vocab"}).raise_for_status()

    def trajectory(reward: float) -> dict[str, Any]:
        return {"messages_and_choices": [*USER, {"message": {"role": "assistant", "content": "y"},
                                                 "prompt_token_ids": [1, 2], "token_ids": [10**9, 2],
                                                 "logprobs": {"content": [{"token": "y", "logprob": -1.0}] * 2},
                                                 "finish_reason": "stop"}],
                "reward": reward}

    response = http.post("/v1/training/models/p/vocab/train",
                         json={"groups": [{"trajectories": [trajectory(0.0), trajectory(1.0)]}]})
    assert response.status_code == 400 and "outside this model's vocabulary" in response.json()["error"]["message"]


def test_a_grammar_that_cannot_be_followed_fails_alone(http: httpx.Client) -> None:
    # no finite JSON value has this shape: every node must hold another
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}, "required": ["child"]}
    endless = {"$defs": {"node": node}, "$ref": "#/$defs/node"}

    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=dict(http.headers), timeout=120) as client:
            return list(await asyncio.gather(
                client.post("/v1/chat/completions", json={
                    "model": TINY, "messages": USER, "max_tokens": 64,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": endless}}}),
                *(client.post("/v1/chat/completions", json={"model": TINY, "messages": USER, "max_tokens": 16})
                  for _ in range(6))))

    failed, *others = asyncio.run(together())
    assert failed.status_code == 400 and "cannot be enforced" in failed.json()["error"]["message"]
    assert [r.status_code for r in others] == [200] * 6


def test_extreme_sampling_settings_fail_alone_or_mean_what_vllm_means(http: httpx.Client) -> None:
    async def together() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=dict(http.headers), timeout=120) as client:
            return list(await asyncio.gather(
                *(client.post("/v1/chat/completions", json={
                    "model": TINY, "messages": USER, "max_tokens": 4, "repetition_penalty": penalty})
                  for penalty in (5e-324, 1e300)),
                *(client.post("/v1/chat/completions", json={"model": TINY, "messages": USER, "max_tokens": 8})
                  for _ in range(4))))

    responses = asyncio.run(together())
    for response in responses[:2]:  # their logits overflow float32: a 400 naming the setting, theirs alone
        assert response.status_code == 400 and "repetition_penalty" in response.json()["error"]["message"]
    assert [r.status_code for r in responses[2:]] == [200] * 4

    # a temperature below 1e-5 is greedy (vLLM's rule), not the unscaled distribution
    greedy = chat(http, temperature=0.0, max_tokens=6, logprobs=True).json()["choices"][0]
    tiny = chat(http, temperature=1e-300, max_tokens=6, logprobs=True).json()["choices"][0]
    assert tiny["message"]["content"] == greedy["message"]["content"]

    # a top-k cut shapes the draw, not the logprobs: those are the policy's own (docs/training/grpo.md),
    # so the tokens past the cut keep theirs, finite and below the drawn one's
    cut = chat(http, temperature=1.0, top_k=1, logprobs=True, top_logprobs=3, return_token_ids=True)
    assert cut.status_code == 200
    first = cut.json()["choices"][0]["logprobs"]["content"][0]
    assert first["token"] == first["top_logprobs"][0]["token"]  # top_k=1 draws the likeliest
    assert all(-9999.0 < t["logprob"] < first["logprob"] for t in first["top_logprobs"][1:])


def test_a_tool_whose_schema_has_definitions_gets_a_well_formed_call(http: httpx.Client) -> None:
    # what pydantic writes for a nested model, as LangChain's with_structured_output sends it
    parameters = {"type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
                  "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                                      "required": ["city"]}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    response = chat(http, max_tokens=60, tools=tools, tool_choice="required")
    assert response.status_code == 200
    choice = response.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":  # the tiny model may run out of tokens inside the string
        assert isinstance(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])["place"], dict)


def test_tool_call_arguments_come_back_as_written_and_render_again_the_same(tiny_engine: Any) -> None:
    formatter = ChatFormatter(tiny_engine.tokenizer)
    written = '{"x": 62543E36777, "y": 69E25, "z": -0e9, "city": "São Paulo"}'
    parsed = formatter.parse(f'<tool_call>\n{{"name": "f", "arguments": {written}}}\n</tool_call>')
    (call,) = parsed.tool_calls
    assert call.arguments == written  # valid JSON, spelled as the model spelled it
    json.loads(call.arguments)
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "f", "arguments": call.arguments}}]}]
    assert f'{{"name": "f", "arguments": {written}}}' in formatter.render(history, None, None)
    # LangChain sends json.dumps(args), non-ASCII escaped: put back the way the model writes it
    langchain = json.dumps({"city": "São Paulo"})
    history[1]["tool_calls"][0]["function"]["arguments"] = langchain
    assert '"arguments": {"city": "São Paulo"}' in formatter.render(history, None, None)
    nan = formatter.parse('<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>')
    assert not nan.tool_calls and "NaN is not JSON" in nan.parse_error


def test_token_records_are_bounded_in_bytes() -> None:
    records = TokenRecords(budget_bytes=10_000)
    logprobs = [TokenLogprob(t, -0.5) for t in range(100)]
    for i in range(20):  # each record: 200 prompt ids + 100 ids at 4 bytes, 100 logprobs at 8: 2,000 bytes
        records.add(f"c{i}", TINY, list(range(200)), list(range(100)), logprobs)
    assert records.get("c0") is None and records.get("c19") == {
        "model": TINY, "prompt_token_ids": list(range(200)), "token_ids": list(range(100)),
        "logprobs": [-0.5] * 100}
    assert sum(records.get(f"c{i}") is not None for i in range(20)) == 5
