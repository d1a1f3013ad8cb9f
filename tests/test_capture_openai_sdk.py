"""Capture at the openai SDK's transport: plain SDK calls inside `art_capture()` are recorded
with their exact tokens (sync and async clients, chat completions and Responses, streamed and
not), a call an integration records too is kept once, and calls to any other server pass
through unrecorded; ART 0.5.23's capture API (`trajectory`, `trajectory_group`,
`current_trajectory`, `no_capture`) on the same core. Against the tiny model."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

import art_integrations as art
from art_integrations import Trajectory, art_capture
from art_integrations.capture import tokens as capture_tokens
from art_integrations.langchain import ARTCallbackHandler, ChatART
from art_integrations.llamaindex import ARTLLM
from art_integrations.wire import BACKEND_HEADER
from tests.conftest import ServerThread

MODEL = "tiny-random-smollm2"
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {
    "q": {"type": "string", "maxLength": 5}}, "required": ["q"]}}  # short: the tiny model's arguments are random


@pytest.fixture(scope="module")
def url(tiny_server: ServerThread) -> str:
    return f"{tiny_server.base_url}/v1"


def exact(trajectory: Trajectory) -> list[tuple[int, int, int]]:
    """Each recorded turn as (prompt tokens, reply tokens, logprobs): all three present."""
    turns = [(len(c.prompt_token_ids or []), len(c.token_ids or []), len(c.token_logprobs or []))
             for history in trajectory.histories() for c in history.choices()]
    assert all(prompt and reply == logprobs for prompt, reply, logprobs in turns), turns
    return turns


@pytest.fixture
def no_token_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport reads each call's tokens and logprobs from its reply: a second request fails the test."""
    def fetch(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"a token fetch was made: {args}")
    monkeypatch.setattr(capture_tokens._http, "post", fetch)


async def test_every_sdk_call_is_recorded_with_its_exact_tokens(url: str, no_token_fetch: None) -> None:
    sync, aio = openai.OpenAI(base_url=url, api_key="unused"), openai.AsyncOpenAI(base_url=url, api_key="unused")
    async with art_capture() as trajectory:
        whole = sync.chat.completions.create(model=MODEL, messages=HI, max_tokens=5)
        stream = await aio.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                                   max_tokens=5, stream=True)
        streamed = [chunk async for chunk in stream]
        response = await aio.responses.create(model=MODEL, input="hello", instructions="Be brief.",
                                              max_output_tokens=5)
        with sync.responses.create(model=MODEL, input="hey", max_output_tokens=5, stream=True) as events:
            last = list(events)[-1].response
    assert trajectory.metrics == {"model_calls": 4} and not trajectory.logs
    assert len(exact(trajectory)) == 4
    replies = [history.choices()[0] for history in trajectory.histories()]
    assert replies[0].token_ids == whole.choices[0].model_extra["token_ids"]
    chunks = [chunk.choices[0].model_extra for chunk in streamed if chunk.choices]
    assert replies[1].token_ids == [token for chunk in chunks for token in chunk.get("token_ids") or []]
    assert replies[2].token_ids == response.model_extra["token_ids"]
    assert replies[3].token_ids == last.model_extra["token_ids"]
    ids = [whole.choices[0].message.id, streamed[-1].choices[0].delta.id, response.model_extra["token_record_id"],
           last.model_extra["token_record_id"]]
    with httpx.Client() as client:  # what the backend keeps for each reply is what the capture read from it
        records = client.post(f"{url}/art/token_records", json={"ids": ids}).json()["records"]
    for reply, record_id in zip(replies, ids):
        assert (reply.prompt_token_ids, reply.token_ids) == (records[record_id]["prompt_token_ids"],
                                                             records[record_id]["token_ids"])
        assert reply.token_logprobs == pytest.approx(records[record_id]["logprobs"])
    assert trajectory.additional_histories[1].messages()[0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_each_of_n_chat_samples_is_a_history_with_its_own_tokens(url: str, stream: bool,
                                                                       no_token_fetch: None) -> None:
    """n=3: three samples of one prompt, each recorded (not only the first) as a history of its own;
    the agent going on from one of them continues that one's history."""
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    async with art_capture() as trajectory:
        reply = await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=5, n=3, temperature=1.0,
                                                     seed=1, stream=stream)
        if stream:
            tokens: dict[int, list[int]] = {}
            texts: dict[int, str] = {}
            async for chunk in reply:
                for choice in chunk.choices:
                    tokens.setdefault(choice.index, []).extend(choice.model_extra.get("token_ids") or [])
                    texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        else:
            tokens = {c.index: c.model_extra["token_ids"] for c in reply.choices}
            texts = {c.index: c.message.content or "" for c in reply.choices}
        await client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            *HI, {"role": "assistant", "content": texts[2]}, {"role": "user", "content": "and?"}])
    assert trajectory.metrics == {"model_calls": 4} and not trajectory.logs, trajectory.logs
    exact(trajectory)
    histories = trajectory.histories()
    assert [h.choices()[0].token_ids for h in histories] == [tokens[0], tokens[1], tokens[2]]
    assert [len(h.choices()) for h in histories] == [1, 1, 2]  # the third sample, continued


async def test_a_responses_conversation_is_one_history(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")
    conversation: list[Any] = [{"role": "user", "content": "look it up"}]
    async with art_capture() as trajectory:
        # greedy, with room: sampled, the random model's forced call can run past a short limit (seen once)
        first = await client.responses.create(model=MODEL, input=conversation, tools=[TOOL], max_output_tokens=80,
                                              tool_choice={"type": "function", "name": "lookup"}, temperature=0)
        (call,) = [item for item in first.output if item.type == "function_call"]
        conversation += [item.model_dump(exclude_none=True) for item in first.output]
        conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": "42"})
        await client.responses.create(model=MODEL, input=conversation, tools=[TOOL], max_output_tokens=5)
    assert len(exact(trajectory)) == 2 and not trajectory.additional_histories
    assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
    assert trajectory.messages()[1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert trajectory.tools == [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]


async def test_a_call_an_integration_records_is_kept_once(url: str, no_token_fetch: None) -> None:
    chat_art = ChatART(model=MODEL, base_url=url, max_tokens=5)
    handled = ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_tokens=5)
    llm = ARTLLM(model=MODEL, api_base=url, max_tokens=5)
    async with art_capture() as trajectory:
        await chat_art.ainvoke("one")
        await handled.ainvoke("two", config={"callbacks": [ARTCallbackHandler()]})
        await llm.acomplete("three")
        await chat_art.ainvoke("four", stream=True)
        await ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_tokens=5).ainvoke("five")  # no handler
    assert trajectory.metrics == {"model_calls": 5} and len(exact(trajectory)) == 5


async def test_calls_to_another_server_pass_through_unrecorded(url: str, other_server: ServerThread) -> None:
    judge = openai.AsyncOpenAI(base_url=f"{other_server.base_url}/v1", api_key="unused")
    policy = openai.AsyncOpenAI(base_url=url, api_key="unused")
    request = {"model": MODEL, "messages": HI, "max_tokens": 5, "temperature": 0}
    outside = (await judge.chat.completions.with_raw_response.create(**request)).http_response
    async with art_capture() as trajectory:
        await policy.chat.completions.create(**request)
        inside = (await judge.chat.completions.with_raw_response.create(**request)).http_response
        async with judge.responses.with_streaming_response.create(model=MODEL, input="x", max_output_tokens=3,
                                                                  stream=True) as streamed:
            assert not type(streamed.http_response.stream).__name__.endswith("Tee")  # its bytes untouched
            await streamed.read()
        with art.no_capture():  # the policy's own server, as a judge: kept out on purpose
            await policy.chat.completions.create(**request)
    assert trajectory.metrics == {"model_calls": 1}
    replies = [json.loads(response.content)["choices"][0] for response in (inside, outside)]
    assert replies[0]["message"]["content"] == replies[1]["message"]["content"]
    assert BACKEND_HEADER not in inside.headers


def test_outside_a_capture_nothing_is_recorded_or_wrapped(url: str) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused")
    with art_capture():  # the transport is patched from the first capture on
        pass
    with client.chat.completions.with_streaming_response.create(model=MODEL, messages=HI, max_tokens=3,
                                                                 stream=True) as streamed:
        assert isinstance(streamed.http_response.stream, (httpx.SyncByteStream, httpx.AsyncByteStream))
        assert not type(streamed.http_response.stream).__name__.endswith("Tee")
        streamed.read()
    assert art.current_trajectory() is None


async def test_arts_capture_api_runs_on_the_same_core(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused")

    async def rollout(reward: float) -> None:
        await client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3)
        art.current_trajectory(require=True).reward = reward

    async def broken() -> None:
        raise ValueError("a tool failed")

    group = await art.trajectory_group([art.trajectory(rollout(r)) for r in (0.0, 1.0)] + [art.trajectory(broken())],
                                       metadata={"scenario": "s"}, return_exceptions=True)
    assert [t.reward for t in group.trajectories] == [0.0, 1.0]
    assert all(len(exact(t)) == 1 for t in group.trajectories)
    assert group.metadata == {"scenario": "s"} and "ValueError: a tool failed" in group.exceptions[0]
    with pytest.raises(ValueError, match="a tool failed"):
        await art.trajectory_group([art.trajectory(broken())])
    with pytest.raises(RuntimeError, match="No trajectory is being captured here"):
        art.current_trajectory(require=True)
    with pytest.raises(TypeError, match="a coroutine not yet started"):
        await art.trajectory(rollout)  # type: ignore[arg-type]
