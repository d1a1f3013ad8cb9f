"""The HTTP API through the clients users have: the openai SDK and langchain-openai, on the
embedded model served by each engine (torch and vLLM). Chat completions, then the Responses API
(`test_responses_*`), whose bodies and stream events are checked against the SDK's own types."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from art_backend.chat_format import ChatFormatter, encode_prompt
from art_backend.engine.base import Engine
from art_backend.engine.torch_engine import TorchEngine
from art_backend.server import create_app
from tests.conftest import ENGINES, ServerThread, embedded_engine_named

MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# One worked example in the history is enough for the 135M model to answer with a valid call.
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "London"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    {"role": "assistant", "content": "It is 12 C and cloudy in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]
TOKEN_IDS = {"return_token_ids": True}


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    return embedded_engine_named(request, request.param)


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


@pytest.fixture
def async_client(server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def test_models_lists_the_base_model(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 8192


def test_sync_completion_token_ids_decode_to_the_text(client: openai.OpenAI, engine: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages,
        max_tokens=24, temperature=0.7, seed=1, logprobs=True, top_logprobs=2, extra_body=TOKEN_IDS)
    choice = response.choices[0]
    token_ids = choice.model_extra["token_ids"]
    tokenizer = engine.tokenizer
    assert tokenizer.decode(token_ids, skip_special_tokens=True) == choice.message.content
    assert len(choice.logprobs.content) == len(token_ids) == response.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    prompt_ids = response.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == response.usage.prompt_tokens
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    assert prompt_ids == encode_prompt(tokenizer, ChatFormatter(tokenizer).render(messages, None, None))
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_text_completions_carry_exact_tokens_on_each_engine(client: openai.OpenAI, engine: Engine) -> None:
    """/v1/completions (completions.py) on the engine interface: a prompt string tokenized as it is,
    `n` choices with their exact ids and legacy logprobs; streamed, the same ids as whole (greedy)."""
    prompt = "The capital of France is"
    sampled = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, temperature=0.7, seed=1,
                                        logprobs=1)  # (vLLM takes n > 1 only sampled)
    assert sampled.model_extra["prompt_token_ids"] == encode_prompt(engine.tokenizer, prompt)
    assert [choice.index for choice in sampled.choices] == [0, 1]
    for choice in sampled.choices:
        ids = choice.model_extra["token_ids"]
        assert engine.tokenizer.decode(ids, skip_special_tokens=True) == choice.text
        assert len(choice.logprobs.token_logprobs) == len(ids) and all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    streamed = [token for chunk in stream for c in chunk.choices for token in c.model_extra["token_ids"]]
    assert streamed == whole.choices[0].model_extra["token_ids"]


def test_n_samples_come_back_as_separate_choices(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a random animal."}], n=3,
        max_tokens=8, temperature=1.0, seed=3, extra_body=TOKEN_IDS)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in response.choices)
    assert len({tuple(c.model_extra["token_ids"]) for c in response.choices}) > 1


def test_n_greedy_samples_are_copies_or_a_400_that_says_why(client: openai.OpenAI, engine: Engine) -> None:
    """Greedy, n > 1: the torch engine gives n copies of the one greedy answer; vLLM refuses it (its own
    rule), and the refusal is the client's error with the way forward, not a 500."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Pick an animal."}], n=2, max_tokens=6,
                   temperature=0, extra_body=TOKEN_IDS)
    if isinstance(engine, TorchEngine):
        response = client.chat.completions.create(**request)
        assert len({tuple(c.model_extra["token_ids"]) for c in response.choices}) == 1
        assert len(response.choices) == 2
        return
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**request)
    assert "temperature above 0" in str(refused.value)


async def test_async_streaming_carries_token_ids_and_usage(async_client: openai.AsyncOpenAI, engine: Engine) -> None:
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=20, temperature=0, logprobs=True, stream=True,
        stream_options={"include_usage": True}, extra_body=TOKEN_IDS)
    chunks = [chunk async for chunk in stream]
    assert chunks[0].model_extra["prompt_token_ids"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    logprobs = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert engine.tokenizer.decode(token_ids, skip_special_tokens=True) == text
    assert len(logprobs) == len(token_ids) == chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == []
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])

    sync_text = (await async_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write one sentence about the sea."}],
        max_tokens=20, temperature=0)).choices[0].message.content
    assert sync_text == text


def test_named_tool_choice_returns_a_parsed_tool_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=TOKEN_IDS)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")


def test_streamed_tool_call_matches_the_non_streamed_one(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=FEW_SHOT, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = [tc for chunk in stream if chunk.choices for tc in chunk.choices[0].delta.tool_calls or []]
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_langchain_bind_tools_round_trip(server: ServerThread) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city"""
        return "21 C, sunny" if city == "Paris" else "unknown"

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="unused", temperature=0, max_tokens=40)
    model = llm.bind_tools([get_weather], tool_choice="get_weather")
    history = [openai_message_to_langchain(m) for m in FEW_SHOT]
    ai = model.invoke(history)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"}
    result = get_weather.invoke(call["args"])
    final = llm.bind_tools([get_weather]).invoke([*history, ai, ToolMessage(result, tool_call_id=call["id"])])
    assert isinstance(final.content, str) and final.content
    assert final.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


def openai_message_to_langchain(message: dict):  # noqa: ANN201 - a LangChain message
    from langchain_core.messages import AIMessage, SystemMessage

    if message["role"] == "user":
        return HumanMessage(message["content"])
    if message["role"] == "system":
        return SystemMessage(message["content"])
    if message["role"] == "tool":
        return ToolMessage(message["content"], tool_call_id=message["tool_call_id"])
    calls = [{"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"]), "id": c["id"]}
             for c in message.get("tool_calls") or []]
    return AIMessage(message["content"] or "", tool_calls=calls)


def test_unparseable_tool_markup_is_flagged_not_an_error(client: openai.OpenAI) -> None:
    # a required call cut off by max_tokens leaves markup that cannot parse
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_tokens=6, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>\n")
    assert "did not parse" in choice.model_extra["tool_call_parse_error"]


def test_required_tool_call_is_always_well_formed(client: openai.OpenAI) -> None:
    other = {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                              "parameters": WEATHER_TOOL["function"]["parameters"]}}
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Oslo?"}], n=4, seed=5,
        tools=[WEATHER_TOOL, other], tool_choice="required", parallel_tool_calls=False, max_tokens=60,
        temperature=1.0)
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name in ("get_weather", "get_time")
        assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_response_format_json_schema_is_enforced(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert response.choices[0].finish_reason == "stop"
    data = json.loads(response.choices[0].message.content)
    assert set(data) == {"city", "is_capital"} and isinstance(data["is_capital"], bool)
    obj = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Give a JSON object with the key "name" set to "Bob".'}],
        max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert json.loads(obj.choices[0].message.content) == {"name": "Bob"}


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def test_too_long_context_is_a_400_naming_the_limit(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 8192"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 9000}])
    with pytest.raises(openai.BadRequestError, match="8192"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9000)


@pytest.mark.parametrize(("body", "field"), [
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 5}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_malformed_body_is_a_422_naming_the_field(server: ServerThread, body: dict, field: str) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_bad_tool_choice_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in `tools`"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


async def test_sixteen_concurrent_requests_all_complete(async_client: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> int:
        response = await async_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=16, temperature=1.0, extra_body=TOKEN_IDS)
        return len(response.choices[0].model_extra["token_ids"])

    counts = await asyncio.gather(*(one(i) for i in range(16)))
    assert all(0 < n <= 16 for n in counts)
    # the server is still healthy afterwards
    assert httpx.get(f"{async_client.base_url}".removesuffix("/v1/") + "/health").json() == {"status": "ok"}


def test_api_key_is_checked_on_every_route(tiny_engine: TorchEngine) -> None:
    with ServerThread(create_app(tiny_engine, api_key="s3cret")) as running:
        assert httpx.get(f"{running.base_url}/health").status_code == 401
        assert httpx.get(f"{running.base_url}/v1/models").status_code == 401
        assert httpx.get(f"{running.base_url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(f"{running.base_url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="s3cret")
        assert client.chat.completions.create(model="tiny-random-smollm2", max_tokens=2,
                                              messages=[{"role": "user", "content": "x"}]).choices


def test_serving_off_loopback_requires_an_api_key() -> None:
    result = subprocess.run([sys.executable, "-m", "art_backend", "serve", "--host", "0.0.0.0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "--api-key" in result.stderr


def test_output_changing_fields_the_server_lacks_are_refused_by_name(tiny_server: ServerThread,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    url = f"{tiny_server.base_url}/v1/chat/completions"
    base = {"model": "tiny-random-smollm2", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    refused = httpx.post(url, json={**base, "use_beam_search": True, "min_tokens": 5, "best_of": 1})
    assert refused.status_code == 400
    assert "min_tokens, use_beam_search" in refused.json()["error"]["message"]
    # at the values that say what the server does anyway, and OpenAI's fields without effect: accepted
    same = {"use_beam_search": False, "skip_special_tokens": True, "user": "u-1", "metadata": {"a": "b"}, "store": False}
    with caplog.at_level(logging.WARNING, logger="art_backend.chat_service"):
        assert httpx.post(url, json={**base, **same}).status_code == 200
        assert "Ignoring" not in caplog.text
        assert httpx.post(url, json={**base, "frobnicate": 1}).status_code == 200
    assert "Ignoring request fields this server does not know: frobnicate" in caplog.text


@pytest.mark.parametrize(("logit_bias", "status", "says"), [
    ({"99999999": 1.0}, 400, "outside the vocabulary"),
    ({"comma": 1.0}, 422, "logit_bias.comma"),
    ({"11": 101.0}, 422, "logit_bias.11"),
])
def test_a_bad_logit_bias_is_refused_naming_the_entry(tiny_server: ServerThread, logit_bias: dict, status: int,
                                                      says: str) -> None:
    response = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={
        "model": "tiny-random-smollm2", "messages": [{"role": "user", "content": "x"}], "logit_bias": logit_bias})
    assert response.status_code == status and says in response.json()["error"]["message"]


def test_the_sampling_settings_users_send_reach_the_engine(tiny_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Say something."}]
    plain = client.chat.completions.create(model="tiny-random-smollm2", messages=messages, max_tokens=12,
                                           temperature=0, logprobs=True, extra_body=TOKEN_IDS)
    token = plain.choices[0].model_extra["token_ids"][0]
    banned = client.chat.completions.create(
        model="tiny-random-smollm2", messages=messages, max_tokens=12, temperature=0, logprobs=True,
        frequency_penalty=1.5, presence_penalty=1.0, logit_bias={str(token): -100},
        extra_body={**TOKEN_IDS, "repetition_penalty": 1.3, "top_k": 5, "min_p": 0.05})
    assert banned.choices[0].model_extra["token_ids"][0] != token


# ----- the Responses API ----------------------------------------------------------------

RESPONSE_EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# FEW_SHOT as Responses input items
RESPONSES_FEW_SHOT: list[dict[str, Any]] = [
    {"role": "user", "content": "What is the weather in London?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps({"city": "London"})},
    {"type": "function_call_output", "call_id": "call_1", "output": "12 C, cloudy"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "It is 12 C and cloudy in London."}]},
    {"role": "user", "content": "What is the weather in Paris?"},
]
NAMED = {"type": "function", "name": "get_weather"}


def create_response(client: openai.OpenAI, **request: Any) -> Response:
    """`responses.create`, its raw body validated against the SDK's Response type."""
    raw = client.responses.with_raw_response.create(model=MODEL, **request)
    assert raw.headers["x-art-backend"] == "1"
    return Response.model_validate(raw.http_response.json())


def streamed_response(client: openai.OpenAI, **request: Any) -> list[Any]:
    with client.responses.create(model=MODEL, stream=True, **request) as stream:
        events = list(stream)
    for number, event in enumerate(events):
        RESPONSE_EVENT.validate_python(event.model_dump())
        assert event.sequence_number == number
    return events


def test_responses_text_reply_carries_its_exact_tokens(client: openai.OpenAI, engine: Engine) -> None:
    response = create_response(client, input="Write one sentence about the sea.", instructions="Be brief.",
                      max_output_tokens=20, temperature=0, include=["message.output_text.logprobs"])
    extra = response.model_extra or {}
    assert response.status in ("completed", "incomplete") and response.output_text
    assert engine.tokenizer.decode(extra["token_ids"], skip_special_tokens=True) == response.output_text
    assert "Be brief." in engine.tokenizer.decode(extra["prompt_token_ids"])
    (message,) = response.output
    assert len(message.content[0].logprobs) == len(extra["token_ids"]) == response.usage.output_tokens
    assert response.usage.input_tokens == len(extra["prompt_token_ids"])
    assert extra["token_record_id"].startswith("chatcmpl-")


def test_responses_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI) -> None:
    response = create_response(client, input="Count from one to one hundred.", max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_responses_stream_says_what_the_whole_response_says(client: openai.OpenAI) -> None:
    request = {"input": "Write one sentence about the sea.", "max_output_tokens": 20, "temperature": 0}
    events = streamed_response(client, **request)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == create_response(client, **request).output_text
    assert final.model_extra["token_ids"] and final.model_extra["prompt_token_ids"]


def test_responses_named_tool_choice_returns_a_function_call_and_the_next_turn_continues(client: openai.OpenAI) -> None:
    first = create_response(client, input=RESPONSES_FEW_SHOT, tools=[WEATHER], tool_choice=NAMED, temperature=0, max_output_tokens=40)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    second = create_response(client, input=[*RESPONSES_FEW_SHOT, *[item.model_dump(exclude_none=True) for item in first.output],
                                   {"type": "function_call_output", "call_id": call.call_id, "output": "20 C, sunny"}],
                    tools=[WEATHER], temperature=0, max_output_tokens=10)
    before = first.model_extra["prompt_token_ids"] + first.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(before)] == before  # one token sequence across turns


def test_responses_streamed_function_call_matches_the_whole_one(client: openai.OpenAI) -> None:
    request = {"input": RESPONSES_FEW_SHOT, "tools": [WEATHER], "tool_choice": NAMED, "temperature": 0, "max_output_tokens": 40}
    events = streamed_response(client, **request)
    done = [event.item for event in events if event.type == "response.output_item.done"
            and event.item.type == "function_call"]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    whole = [item for item in create_response(client, **request).output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in whole]
    assert arguments == whole[0].arguments


@pytest.mark.parametrize(("request_fields", "named"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0] of type 'web_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "'input_image'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "'item_reference'"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
])
def test_responses_fields_not_served_are_refused_by_name(tiny_server: ServerThread, request_fields: dict[str, Any],
                                               named: str) -> None:
    body = {"model": "tiny-random-smollm2", "input": "Hi", **request_fields}
    response = httpx.post(f"{tiny_server.base_url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"]["message"]


def test_responses_text_format_json_schema_is_enforced(tiny_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused")
    # closed and greedy: sampled, the random model could add properties until max_output_tokens cut the JSON
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.responses.create(model="tiny-random-smollm2", input="Is it fine?", max_output_tokens=40,
                                       temperature=0,
                                       text={"format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert response.status == "completed" and isinstance(json.loads(response.output_text)["ok"], bool)
    assert response.text.format.name == "answer"
    malformed = httpx.post(f"{tiny_server.base_url}/v1/responses", timeout=30, json={
        "model": "tiny-random-smollm2", "input": "x", "text": {"format": "json"}})
    assert malformed.status_code == 422 and "text.format" in malformed.json()["error"]["message"]
