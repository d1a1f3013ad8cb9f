"""The capture under today's newest client stack, as a user who installs the client package beside the
newest openai SDK (3.x, which sends through httpx2) gets it, against `art-backend serve` on the tiny
model: the SDK's calls (chat, streamed chat, Responses, text completions), a hand-written request of
each HTTP client (httpx, httpx2, requests, aiohttp; sync, async; whole, streamed), and a smolagents
agent pointed at the backend are recorded with the exact tokens the backend produced; calls to
another server are not, and leave as they were written."""

from __future__ import annotations

import importlib.util
from typing import Any

import httpx
import openai
import pytest
from http_calls import CLIENTS, Received, installed, send

from art_integrations import Trajectory, art_capture
from art_integrations.wire import TOKEN_LOGPROBS_HEADER

MODEL = "tiny-random-smollm2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_this_venv_has_the_newest_sdk() -> None:
    """What these tests are for: the SDK major that sends through httpx2, not httpx."""
    assert int(openai.__version__.split(".")[0]) >= 3, openai.__version__
    import openai._base_client as base

    assert hasattr(base, "httpx2")


def kept(backend_url: str, ids: list[str]) -> dict[str, Any]:
    with httpx.Client() as client:
        return client.post(f"{backend_url}/v1/art/token_records", json={"ids": ids}).json()["records"]


def exact(trajectory: Trajectory, backend_url: str, record_ids: list[str]) -> list[Any]:
    """The recorded turns, each checked against what the backend kept under its record id."""
    assert not trajectory.logs, trajectory.logs
    turns = [choice for history in trajectory.histories() for choice in history.choices()]
    records = kept(backend_url, record_ids)
    assert len(turns) == len(record_ids)
    for turn, record_id in zip(turns, record_ids):
        assert (turn.prompt_token_ids, turn.token_ids) == (records[record_id]["prompt_token_ids"],
                                                           records[record_id]["token_ids"])
        assert turn.token_logprobs == pytest.approx(records[record_id]["logprobs"])
    return turns


async def test_the_sdks_calls_are_recorded_with_their_exact_tokens(backend_url: str) -> None:
    sync = openai.OpenAI(base_url=f"{backend_url}/v1", api_key="unused")
    aio = openai.AsyncOpenAI(base_url=f"{backend_url}/v1", api_key="unused")
    async with art_capture() as trajectory:
        whole = sync.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=4)
        stream = await aio.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "yo"}],
                                                   max_tokens=4, stream=True)
        chunks = [chunk async for chunk in stream]
        response = await aio.responses.create(model=MODEL, input="hello", max_output_tokens=4)
        text = sync.completions.create(model=MODEL, prompt="Once", max_tokens=4)
    ids = [whole.choices[0].message.id, chunks[-1].choices[0].delta.id, response.model_extra["token_record_id"],
           text.choices[0].model_extra["token_record_id"]]
    turns = exact(trajectory, backend_url, ids)
    assert turns[0].token_ids == whole.choices[0].model_extra["token_ids"]
    assert turns[3].token_ids == text.choices[0].model_extra["token_ids"]
    assert trajectory.metrics["model_calls"] == 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_each_clients_call_is_recorded(client: str, stream: bool, backend_url: str) -> None:
    assert installed(client), f"{client} belongs in this venv (make setup-clients)"
    async with art_capture() as trajectory:
        received: Received = await send(client, f"{backend_url}/v1/chat/completions", CHAT, stream=stream)
    turns = exact(trajectory, backend_url, [received.record_id])  # type: ignore[list-item]
    assert turns[0].token_ids == received.token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_each_clients_call_to_another_server_passes_through(client: str, stream: bool,
                                                                  other_server: Any) -> None:
    before = len(other_server.seen)
    async with art_capture() as trajectory:
        received = await send(client, f"{other_server.url}/v1/chat/completions", CHAT, stream=stream)
    assert received.text == "fine" and trajectory.metrics["model_calls"] == 0
    assert [TOKEN_LOGPROBS_HEADER in headers for headers in other_server.seen[before:]] == [False]


async def test_the_sdk_to_another_server_is_not_recorded(other_server: Any) -> None:
    judge = openai.AsyncOpenAI(base_url=f"{other_server.url}/v1", api_key="unused")
    async with art_capture() as trajectory:
        reply = await judge.chat.completions.create(**CHAT)
    assert reply.choices[0].message.content == "fine" and trajectory.metrics["model_calls"] == 0


@pytest.mark.skipif(importlib.util.find_spec("smolagents") is None, reason="smolagents did not install here")
async def test_a_smolagents_agent_pointed_at_the_backend_is_recorded(backend_url: str) -> None:
    """smolagents' ToolCallingAgent on OpenAIServerModel, as its docs point it at a vLLM server: every
    model call of the run is recorded with its exact tokens (the tiny model's tool calls are noise, so
    the run ends at its step limit with smolagents' own final-answer call)."""
    import asyncio

    from smolagents import OpenAIServerModel, ToolCallingAgent

    model = OpenAIServerModel(model_id=MODEL, api_base=f"{backend_url}/v1", api_key="unused", max_tokens=8)
    agent = ToolCallingAgent(tools=[], model=model, max_steps=1, verbosity_level=0)
    async with art_capture() as trajectory:
        await asyncio.to_thread(agent.run, "What is 2 + 2?")
    turns = [choice for history in trajectory.histories() for choice in history.choices()]
    assert turns and trajectory.metrics["model_calls"] == len(turns)
    assert all(t.token_ids and t.prompt_token_ids and len(t.token_logprobs or []) == len(t.token_ids) for t in turns)


@pytest.mark.skipif(importlib.util.find_spec("litellm") is None, reason="litellm did not install here")
@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
async def test_litellm_pointed_at_the_backend_is_recorded(provider: str, backend_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """LiteLLM (what CrewAI and DSPy call models through), its vLLM and OpenAI providers, sync and async,
    streamed: each call recorded with the backend's exact tokens."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list at import
    import litellm

    request = {"model": f"{provider}/{MODEL}", "api_base": f"{backend_url}/v1", "api_key": "unused",
               "messages": CHAT["messages"], "max_tokens": 4}
    async with art_capture() as trajectory:
        whole = await litellm.acompletion(**request)
        litellm.completion(**request)
        chunks = [chunk async for chunk in await litellm.acompletion(**request, stream=True)]
    assert whole.choices[0].message.content is not None and chunks
    turns = [choice for history in trajectory.histories() for choice in history.choices()]
    assert trajectory.metrics["model_calls"] == len(turns) == 3, trajectory.logs
    assert all(t.token_ids and t.prompt_token_ids and len(t.token_logprobs or []) == len(t.token_ids) for t in turns)


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None,
                    reason="langchain-openai did not install here")
async def test_a_chat_openai_only_re_pointed_is_recorded(backend_url: str) -> None:
    """langchain-openai's ChatOpenAI with its base URL at the backend and nothing else changed (no
    ChatART, no handler, no extra_body): recorded with the exact tokens, streamed or not."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{backend_url}/v1", api_key="unused", max_tokens=4)
    async with art_capture() as trajectory:
        await llm.ainvoke("hi")
        [chunk async for chunk in llm.astream("yo")]
    turns = [choice for history in trajectory.histories() for choice in history.choices()]
    assert not trajectory.logs and trajectory.metrics["model_calls"] == len(turns) == 2
    assert all(t.token_ids and t.prompt_token_ids and len(t.token_logprobs or []) == len(t.token_ids) for t in turns)


@pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="openai-agents did not install here")
async def test_an_agents_sdk_agent_is_captured_grouped_and_trained(backend_url: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The OpenAI Agents SDK on openai 3.x (its Responses API through httpx2), only its base URL pointed
    at the backend: a handoff's rollouts captured with exact tokens (the handoff, then the researcher's
    tool call in a history of its own), grouped, and trained one step on the served backend."""
    import agents
    from agents import ModelSettings, Runner, function_tool, set_tracing_disabled

    from art_integrations import RemoteBackend, TrainableModel, TrajectoryGroup
    from art_integrations.gather import gather_trajectory_groups
    from art_integrations.training import TrainConfig

    backend = RemoteBackend(backend_url)
    model = TrainableModel(name="agents-sdk-3", project="clients")
    await model.register(backend)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{backend_url}/v1")  # the one setting that points it here
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    set_tracing_disabled(True)  # its traces would go to OpenAI's own servers

    @function_tool
    def current_time() -> str:
        """The time now."""
        return "12:00"

    # the researcher's run ends with its tool's answer: a free-text reply of the random model would run
    # to its token limit, which this SDK version raises as an incomplete response
    researcher = agents.Agent(name="researcher", instructions="Answer with the time.", model=model.inference_name,
                              tools=[current_time], tool_use_behavior="stop_on_first_tool",
                              model_settings=ModelSettings(tool_choice="current_time", max_tokens=40))
    triage = agents.Agent(name="triage", instructions="Hand the question to the researcher.",
                          model=model.inference_name, handoffs=[researcher],
                          model_settings=ModelSettings(tool_choice="transfer_to_researcher", max_tokens=40))

    async def rollout(reward: float) -> Trajectory:
        async with art_capture() as trajectory:
            result = await Runner.run(triage, "What time is it?", max_turns=4)
        assert result.last_agent is researcher and result.final_output == "12:00"
        trajectory.reward = reward
        return trajectory

    (group,) = await gather_trajectory_groups([TrajectoryGroup(rollout(r) for r in (0.0, 1.0))], progress=False)
    for trajectory in group.trajectories:
        assert not trajectory.logs, trajectory.logs
        assert [len(h.choices()) for h in trajectory.histories()] == [1, 1]  # triage's handoff; the researcher's call
        assert all(c.token_ids and c.prompt_token_ids and c.token_logprobs
                   for h in trajectory.histories() for c in h.choices())
    result = await model.train([group], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1
