"""LangGraph and LangChain agents captured with exact tokens: the drop-in model, the handler,
sub-agents, parallel tool calls, streaming, structured output, concurrency, and training."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Literal

import pytest
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import MessagesState
from langgraph.prebuilt import create_react_agent
from pydantic import BaseModel

from art_integrations import (
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    art_capture,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.langchain import ARTCallbackHandler, ChatART
from tests.conftest import ServerThread, supervisor_graph, tiny_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning",
                                        "ignore:create_react_agent has been moved")


City = Literal["Paris", "Rome", "Oslo", "Lima"]  # an enum keeps even the random tiny model's calls short


@tool
def get_weather(city: City) -> str:
    """Get the current weather in a city"""
    return f"21 C and sunny in {city}"


@tool
def get_time(city: City) -> str:
    """Get the local time in a city"""
    return f"10:30 in {city}"


TOOLS = [get_weather, get_time]


def react_agent(llm: Any, parallel: bool = False) -> Any:
    """A ReAct agent whose first turn must call a tool (the base model would not, unprompted)."""

    def model(state: MessagesState, runtime: Any) -> Any:
        first_turn = not any(m.type == "tool" for m in state["messages"])
        return llm.bind_tools(TOOLS, tool_choice="required" if first_turn else "none", parallel_tool_calls=parallel)

    return create_react_agent(model, TOOLS)


def sequences(trajectory: Trajectory) -> tuple[int, TokenizeStats]:
    stats = TokenizeStats()
    return len(tokenize_trajectory(trajectory, 1.0, "t", stats, 8192)), stats


@pytest.fixture(scope="module")
def llm(server: ServerThread) -> ChatART:
    return ChatART(model="SmolLM2-135M-Instruct", base_url=f"{server.base_url}/v1", temperature=0, max_tokens=100,
                   timeout=120)


@pytest.fixture(scope="module")
def tiny_llm(tiny_server: ServerThread) -> ChatART:
    # a client timeout turns a lost HTTP exchange (seen once in a full-suite run) into a retry, not a hang
    return ChatART(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", max_tokens=40, timeout=30)


def test_react_agent_with_two_tools_and_parallel_calls(llm: ChatART) -> None:
    with art_capture(scenario="paris-rome") as trajectory:
        result = react_agent(llm, parallel=True).invoke({"messages": [("user", "What is the weather in Paris and the time in Rome?")]})
    calls = result["messages"][1].tool_calls
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Rome"})]
    assert [m.type for m in result["messages"]] == ["human", "ai", "tool", "tool", "ai"]

    roles = [item["role"] if isinstance(item, dict) else "choice" for item in trajectory.messages_and_choices]
    assert roles == ["user", "choice", "tool", "tool", "choice"]
    first, second = trajectory.choices()
    assert [c["function"]["name"] for c in first.message["tool_calls"]] == ["get_weather", "get_time"]
    assert first.prompt_token_ids and first.token_ids and len(first.token_logprobs) == len(first.token_ids)
    assert trajectory.tools and trajectory.metadata == {"scenario": "paris-rome", "langgraph_nodes": ["agent"]}
    # the second call's prompt extends the first call exactly: one training sequence
    count, stats = sequences(trajectory)
    assert (count, stats.prefix_breaks) == (1, 0)


def test_supervisor_subgraph_calls_become_an_additional_history(tiny_llm: ChatART) -> None:
    def researcher(state: MessagesState) -> dict:
        return {"messages": [tiny_llm.invoke([SystemMessage("You research."), state["messages"][0]])]}

    def supervisor(state: MessagesState) -> dict:
        return {"messages": [tiny_llm.invoke(state["messages"])]}

    with art_capture() as trajectory:
        supervisor_graph(supervisor, researcher).invoke({"messages": [HumanMessage("Find facts about owls.")]})
    assert len(trajectory.choices()) == 1  # the supervisor's call
    (sub,) = trajectory.additional_histories
    assert sub.messages_and_choices[0] == {"role": "system", "content": "You research."}
    assert len(sub.choices()) == 1 and sub.choices()[0].token_ids
    assert trajectory.metadata["additional_history_agents"] == ["researcher"]
    assert trajectory.metadata["langgraph_nodes"] == ["research_agent", "supervisor"]
    assert sequences(trajectory)[0] == 2  # each history trains as its own sequence


async def test_streaming_and_astream_events_are_captured(tiny_llm: ChatART) -> None:
    async with art_capture() as streamed:
        chunks = [chunk async for chunk in tiny_llm.astream("Hello")]
        for _ in tiny_llm.stream("Hi again"):
            pass
    assert len(chunks) > 1
    assert [len(c.token_ids or []) for c in streamed.choices()] == [40]
    assert len(streamed.additional_histories) == 1 and streamed.additional_histories[0].choices()[0].token_ids

    async with art_capture() as evented:
        events = [e["event"] async for e in react_agent(tiny_llm).astream_events(
            {"messages": [("user", "weather?")]}, version="v2")]
    assert "on_chat_model_stream" in events and "on_tool_end" in events, sorted(set(events))
    assert evented.metrics["model_calls"] == 2 and len(evented.choices()) == 2
    assert all(c.token_ids for c in evented.choices())


async def test_drop_in_tokens_travel_with_the_reply(tiny_llm: ChatART, monkeypatch: pytest.MonkeyPatch) -> None:
    """ChatART asks for each reply's tokens and logprobs, so the transport reads them from the reply
    and a capture makes no request of its own on exit, even to a backend no client named; they are
    the ones the backend recorded (fetched here explicitly to compare), each call recorded once."""
    import art_integrations.capture as capture
    import art_integrations.capture.tokens as capture_tokens
    import art_integrations.capture.transports.core as transport

    monkeypatch.setattr(transport, "_backends", {})  # as in a fresh process: the server is not yet known

    def no_fetch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the capture fetched tokens although the replies carried them")

    monkeypatch.setattr(capture, "fetch_tokens", no_fetch)
    async with art_capture() as trajectory:
        message = await tiny_llm.ainvoke("Hello")
        streamed = [chunk async for chunk in tiny_llm.astream("Hello again")]
    assert len(streamed) > 1 and trajectory.metrics["model_calls"] == 2
    choices = [choice for history in trajectory.histories() for choice in history.choices()]
    assert [len(c.token_ids or []) for c in choices] == [40, 40]
    assert all(len(c.token_logprobs or []) == 40 and c.prompt_token_ids for c in choices)

    monkeypatch.undo()
    ids = [message.id, sum(streamed[1:], streamed[0]).id]
    records = capture_tokens._http.post(f"{tiny_llm.openai_api_base}/art/token_records",
                                        json={"ids": ids}).json()["records"]
    for choice, record in zip(choices, (records[i] for i in ids)):
        assert choice.token_ids == record["token_ids"] and choice.prompt_token_ids == record["prompt_token_ids"]
        assert choice.token_logprobs == pytest.approx(record["logprobs"], abs=1e-5)


class Forecast(BaseModel):
    city: str
    sunny: bool


@pytest.mark.parametrize("method", ["function_calling", "json_schema", "json_mode"])
def test_with_structured_output_is_captured(llm: ChatART, method: str) -> None:
    prompt = "Is it sunny in Paris? Answer as JSON with the keys city and sunny."
    with art_capture() as trajectory:
        answer = llm.with_structured_output(Forecast, method=method).invoke(prompt)
    assert isinstance(answer, Forecast) and answer.city
    (choice,) = trajectory.choices()
    assert choice.token_ids and choice.prompt_token_ids and len(choice.token_logprobs) == len(choice.token_ids)


async def test_32_concurrent_captures_never_mix(tiny_llm: ChatART) -> None:
    agent = react_agent(tiny_llm)

    async def rollout(i: int) -> Trajectory:
        async with art_capture(rollout=i) as trajectory:
            await agent.ainvoke({"messages": [("user", f"rollout number {i}")]})
        return trajectory

    trajectories = await asyncio.gather(*(rollout(i) for i in range(32)))
    for i, trajectory in enumerate(trajectories):
        assert trajectory.metadata["rollout"] == i
        assert trajectory.messages_and_choices[0] == {"role": "user", "content": f"rollout number {i}"}
        assert len(trajectory.choices()) == 2 and not trajectory.additional_histories


async def test_batch_retry_config_and_nested_captures(tiny_llm: ChatART) -> None:
    model = tiny_llm.with_retry(stop_after_attempt=2).with_config(tags=["t"])
    with art_capture() as outer:
        model.batch(["a", "b"])
        with art_capture() as inner:
            await model.ainvoke("c")
    assert outer.metrics["model_calls"] == 2 and inner.metrics["model_calls"] == 1
    assert inner.messages_and_choices[0] == {"role": "user", "content": "c"}


def test_calls_outside_a_capture_are_served_not_recorded(tiny_llm: ChatART, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="art_integrations"):
        assert isinstance(tiny_llm.invoke("hello"), AIMessage)
    assert "outside art_capture" in caplog.text


async def test_handler_on_a_plain_chat_openai(tiny_server: ServerThread) -> None:
    llm = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                     max_tokens=40, extra_body={"return_token_ids": True})
    handler = ARTCallbackHandler()
    async with art_capture() as trajectory:
        await react_agent(llm).ainvoke({"messages": [("user", "weather in Oslo?")]}, config={"callbacks": [handler]})
    assert len(trajectory.choices()) == 2 and all(c.token_ids and c.prompt_token_ids for c in trajectory.choices())
    assert trajectory.choices()[0].message["tool_calls"]

    plain = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                       max_tokens=4)  # no setting at all: art-backend sends the token ids unasked
    with art_capture() as unasked:
        plain.invoke("hi", config={"callbacks": [handler]})
    assert unasked.choices()[0].token_ids and "capture_errors" not in unasked.metrics

    refused = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                         max_tokens=4, extra_body={"return_token_ids": False})  # the gap is reported, not hidden
    with art_capture() as missing:
        refused.invoke("hi", config={"callbacks": [handler]})
    assert missing.metrics["capture_errors"] == 1 and "return_token_ids" in missing.logs[0]


async def test_handler_calls_take_the_transports_tokens_and_missing_logprobs_are_fetched_once_per_group(
        tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handler sees only a reply's id; its call is joined to the transport's copy of it, whose
    tokens it takes. A backend no client named sends its first replies without logprobs: under
    gather the captures leave that fetch to the group, rewards read the replies as messages, and one
    request per group then puts every reply's exact tokens in place. Nothing is recorded twice."""
    import art_integrations.capture.tokens as capture_tokens
    import art_integrations.capture.transports.core as transport

    monkeypatch.setattr(transport, "_backends", {})  # as in a fresh process: the server is not yet known
    llm = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                     max_tokens=40, extra_body={"return_token_ids": True})
    handler = ARTCallbackHandler()
    fetches: list[list[str]] = []
    post = capture_tokens._http.post

    def counting_post(url: str, **kwargs: Any) -> Any:
        fetches.append(kwargs["json"]["ids"])
        return post(url, **kwargs)

    monkeypatch.setattr(capture_tokens._http, "post", counting_post)

    async def rollout() -> Trajectory:
        async with art_capture() as trajectory:
            await react_agent(llm).ainvoke({"messages": [("user", "weather in Oslo?")]},
                                           config={"callbacks": [handler]})
        assert trajectory.messages()[-1]["role"] == "assistant"
        trajectory.reward = float(len(trajectory.messages()))
        return trajectory

    groups = await gather_trajectory_groups([trajectory_group(rollout, n=4), trajectory_group(rollout, n=3)],
                                            progress=False)
    # at most one request per group, for the first calls only (each rollout's second call came after a
    # reply had named the server a backend, so it brought its logprobs)
    assert 1 <= len(fetches) <= 2 and all(1 <= len(ids) <= 4 for ids in fetches), fetches
    for group in groups:
        for trajectory in group.trajectories:
            assert trajectory.metrics["model_calls"] == 2 and not trajectory.metrics.get("capture_errors")
            assert len(trajectory.choices()) == 2
            assert all(c.token_ids and c.prompt_token_ids and c.token_logprobs for c in trajectory.choices())
            assert trajectory.metadata["langgraph_nodes"] == ["agent"]  # the handler's structure, kept
    count, _ = sequences(groups[0].trajectories[0])
    assert count >= 1  # trainable as fetched
    fetches.clear()
    await rollout()
    assert fetches == []  # the server is known now: every reply brings its tokens


async def test_a_handler_call_the_transport_never_saw_is_kept_as_a_message_and_said(
        tiny_server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens take one path, the transport: a call only an integration saw (a client no adapter
    wraps) has none to be had, so it is a message, not trained on, and the capture says why."""
    import art_integrations.capture.transports.core as transport

    monkeypatch.setattr(transport, "generation_kind", lambda method, path: None)  # the transport sees nothing
    llm = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                     max_tokens=40)
    async with art_capture() as trajectory:
        await react_agent(llm).ainvoke({"messages": [("user", "weather in Oslo?")]},
                                       config={"callbacks": [ARTCallbackHandler()]})
    assert trajectory.choices() == [] and trajectory.messages()[-1]["role"] == "assistant"
    assert trajectory.metrics["capture_errors"] == 2
    assert all("not seen at the HTTP transport" in line for line in trajectory.logs)


async def test_a_captured_agent_trajectory_trains_one_step(tmp_path: Path) -> None:
    async with tiny_backend(tmp_path) as backend:
        model = TrainableModel(name="agent", project="langgraph")
        await model.register(backend)
        agent = react_agent(ChatART.from_model(model, max_tokens=40))
        trajectories = []
        for reward in (0.0, 1.0):
            async with art_capture() as trajectory:
                await agent.ainvoke({"messages": [("user", "weather in Lima?")]})
            trajectory.reward = reward
            trajectories.append(trajectory)
        result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1
    # the random tiny model picks odd token splits that re-rendering alone would not reproduce; the
    # backend continues each answer turn with its tool-call turn's exact ids: one sequence per rollout
    assert (result.metrics["sequences"], result.metrics["prefix_breaks"]) == (2, 0)
