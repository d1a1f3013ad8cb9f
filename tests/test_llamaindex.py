"""LlamaIndex agents captured with exact tokens: the drop-in `ARTLLM`, the instrumentation
handler on a plain `OpenAILike`, multi-agent handoffs, every chat path, structured
prediction, concurrency, and training."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from llama_index.core.agent.workflow import AgentWorkflow, BaseWorkflowAgent, FunctionAgent
from llama_index.core.agent.workflow.multi_agent_workflow import handoff
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike
from pydantic import BaseModel, create_model

from art_backend.engine.torch_engine import TorchEngine
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory
from art_integrations import TrainableModel, TrainConfig, Trajectory, TrajectoryGroup, art_capture
from art_integrations.llamaindex import ARTLLM, ARTEventHandler, instrument
from art_integrations.llamaindex.handler import ARTSpanHandler
from tests.conftest import ServerThread, tiny_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")

City = Literal["Paris", "Rome", "Oslo", "Lima"]  # an enum keeps even the random tiny model's calls short


def get_weather(city: City) -> str:
    """Get the current weather in a city"""
    return f"21 C and sunny in {city}"


def get_time(city: City) -> str:
    """Get the local time in a city"""
    return f"10:30 in {city}"


class CityArgs(BaseModel):
    city: City


# explicit schemas: LlamaIndex cannot resolve string annotations (this module's __future__ import)
TOOLS = [FunctionTool.from_defaults(get_weather, fn_schema=CityArgs),
         FunctionTool.from_defaults(get_time, fn_schema=CityArgs)]


def function_agent(llm: Any, **kwargs: Any) -> FunctionAgent:
    """A FunctionAgent whose first turn must call a tool: the base model would not, unprompted.
    FunctionAgent sends `initial_tool_choice` on the turn that answers the user, then lets the
    model choose; "required" makes the backend's grammar force a valid call. One call per turn,
    or the random tiny model keeps adding calls."""
    return FunctionAgent(tools=TOOLS, llm=llm, initial_tool_choice="required", allow_parallel_tool_calls=False,
                         **kwargs)


def roles(trajectory: Trajectory) -> list[str]:
    return [item["role"] if isinstance(item, dict) else "choice" for item in trajectory.messages_and_choices]


def has_tokens(trajectory: Trajectory) -> bool:
    choices = [c for h in trajectory.histories() for c in h.choices()]
    return bool(choices) and all(c.prompt_token_ids and c.token_ids and len(c.token_logprobs or []) == len(c.token_ids)
                                 for c in choices)


def sequences(trajectory: Trajectory) -> tuple[int, TokenizeStats]:
    stats = TokenizeStats()
    return len(tokenize_trajectory(trajectory, 1.0, "t", stats, 8192)), stats


@pytest.fixture(scope="module")
def llm(server: ServerThread) -> ARTLLM:
    return ARTLLM(model="SmolLM2-135M-Instruct", api_base=f"{server.base_url}/v1", temperature=0, max_tokens=100)


@pytest.fixture(scope="module")
def tiny_llm(tiny_server: ServerThread) -> ARTLLM:
    return ARTLLM(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", max_tokens=40)


@pytest.fixture
def clean_dispatcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """LlamaIndex's root dispatcher without our handlers, restored afterwards, for tests that
    install handlers themselves."""
    root = get_dispatcher()
    monkeypatch.setattr(root, "event_handlers", [h for h in root.event_handlers if not isinstance(h, ARTEventHandler)])
    monkeypatch.setattr(root, "span_handlers", [h for h in root.span_handlers if not isinstance(h, ARTSpanHandler)])
    yield


@pytest.mark.parametrize("streaming", [True, False])
async def test_function_agent_with_two_tools(llm: ARTLLM, embedded_engine: TorchEngine, streaming: bool) -> None:
    assert llm.metadata.is_function_calling_model and llm.context_window == embedded_engine.max_model_len
    async with art_capture(scenario="paris") as trajectory:
        answer = await function_agent(llm, streaming=streaming).run("What is the weather in Paris?")
    assert roles(trajectory) == ["user", "choice", "tool", "choice"]
    first, second = trajectory.choices()
    (call,) = first.message["tool_calls"]
    assert (call["function"]["name"], call["function"]["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert trajectory.messages_and_choices[2]["content"] == "21 C and sunny in Paris"
    assert second.message["content"] == str(answer.response.content)
    assert has_tokens(trajectory) and not trajectory.additional_histories and not trajectory.logs
    assert [t["function"]["name"] for t in trajectory.tools or []] == ["get_weather", "get_time"]
    assert trajectory.metadata == {"scenario": "paris"} and trajectory.metrics == {"model_calls": 2}
    # the second call's prompt extends the first exactly: one training sequence
    count, stats = sequences(trajectory)
    assert (count, stats.prefix_breaks) == (1, 0)


class HandoffByName(AgentWorkflow):
    """AgentWorkflow's handoff tool takes `to_agent` as free text, which the 135M model misspells;
    here it is an enum of the agents it may hand off to, so the backend's grammar spells it."""

    def _get_handoff_tool(self, current_agent: BaseWorkflowAgent) -> Any:
        tool = super()._get_handoff_tool(current_agent)
        if tool is None:
            return None
        names = tuple(name for name in self.agents if name != current_agent.name)
        schema = create_model("Handoff", to_agent=(Literal[names], ...), reason=(Literal["the user asked"], ...))
        return FunctionTool.from_defaults(async_fn=handoff, name="handoff", description=tool.metadata.description,
                                          fn_schema=schema, return_direct=True)


async def test_agent_workflow_handoff_makes_an_additional_history(llm: ARTLLM) -> None:
    planner = FunctionAgent(name="planner", description="Plans, then hands off", llm=llm, tools=[],
                            system_prompt="You hand off to the researcher.", initial_tool_choice="handoff")
    researcher = FunctionAgent(name="researcher", description="Looks up the weather", llm=llm, tools=TOOLS,
                               system_prompt="You research.")
    workflow = HandoffByName(agents=[planner, researcher], root_agent="planner")
    async with art_capture() as trajectory:
        await workflow.run("What is the weather in Rome?")

    assert roles(trajectory) == ["system", "user", "choice"]  # the root agent: the main history
    (call,) = trajectory.choices()[0].message["tool_calls"]
    assert call["function"]["name"] == "handoff" and '"researcher"' in call["function"]["arguments"]
    (research,) = trajectory.additional_histories
    assert research.messages_and_choices[0] == {"role": "system", "content": "You research."}
    assert research.messages()[-2]["role"] == "tool" and "researcher" in research.messages()[-2]["content"]
    assert research.choices() and has_tokens(trajectory)
    assert trajectory.metadata["additional_history_agents"] == ["researcher"]
    assert sequences(trajectory)[0] == 2  # each agent trains as its own sequence


async def test_chat_achat_stream_chat_and_astream_chat_are_captured(tiny_llm: ARTLLM) -> None:
    async with art_capture() as trajectory:
        chat = tiny_llm.chat([ChatMessage(role="user", content="one")])
        achat = await tiny_llm.achat([ChatMessage(role="user", content="two")])
        streamed = list(tiny_llm.stream_chat([ChatMessage(role="user", content="three")]))
        astreamed = [r async for r in await tiny_llm.astream_chat([ChatMessage(role="user", content="four")])]
    assert len(streamed) > 1 and len(astreamed) > 1
    assert trajectory.metrics["model_calls"] == 4 and has_tokens(trajectory)
    histories = trajectory.histories()
    assert [h.messages_and_choices[0]["content"] for h in histories] == ["one", "two", "three", "four"]
    replies = [chat, achat, streamed[-1], astreamed[-1]]
    assert [h.choices()[0].message.get("content") for h in histories] == [r.message.content for r in replies]
    # a call's own extra_body is kept, and tokens are always asked for
    assert tiny_llm._get_model_kwargs(extra_body={"top_k": 5})["extra_body"] == {"top_k": 5, "return_token_ids": True}


class Forecast(BaseModel):
    city: City
    sunny: bool


async def test_predict_and_call_and_structured_predict(llm: ARTLLM, server: ServerThread,
                                                       clean_dispatcher: None) -> None:
    instrument()  # every LLM recorded, wrappers included
    with art_capture() as called:
        result = llm.predict_and_call(TOOLS, "What time is it in Rome?", tool_required=True)
    assert result.sources[0].tool_name == "get_time" and result.response.startswith("10:30 in ")
    assert called.choices()[0].message["tool_calls"] and has_tokens(called)

    prompt = PromptTemplate("Is it sunny in {city}? Answer as JSON with the keys city and sunny.")
    json_llm = ARTLLM(model="SmolLM2-135M-Instruct", api_base=f"{server.base_url}/v1", temperature=0,
                      max_tokens=100, should_use_structured_outputs=True)  # response_format json_schema
    for model in (llm, json_llm):
        async with art_capture() as structured:
            forecast = await model.astructured_predict(Forecast, prompt, city="Paris")
        assert isinstance(forecast, Forecast) and forecast.city == "Paris"
        assert structured.metrics["model_calls"] == 1 and has_tokens(structured)

    # a StructuredLLM wraps the call its inner LLM makes: recorded once, as the inner call
    with art_capture() as wrapped:
        reply = llm.as_structured_llm(Forecast).chat([ChatMessage(role="user", content="Sunny in Oslo?")])
    assert isinstance(reply.raw, Forecast)
    assert wrapped.metrics["model_calls"] == 1 and has_tokens(wrapped) and not wrapped.logs


async def test_8_concurrent_captures_never_mix(tiny_llm: ARTLLM) -> None:
    agent = function_agent(tiny_llm)

    async def rollout(i: int) -> Trajectory:
        async with art_capture(rollout=i) as trajectory:
            await agent.run(f"rollout number {i}")
        return trajectory

    trajectories = await asyncio.gather(*(rollout(i) for i in range(8)))
    for i, trajectory in enumerate(trajectories):
        assert trajectory.metadata == {"rollout": i}
        assert trajectory.messages_and_choices[0] == {"role": "user", "content": f"rollout number {i}"}
        assert len(trajectory.choices()) == 2 and not trajectory.additional_histories and has_tokens(trajectory)


async def test_calls_outside_a_capture_and_failed_calls(tiny_llm: ARTLLM, tiny_server: ServerThread,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="art_integrations"):
        assert tiny_llm.complete("hello").text is not None
    assert "outside art_capture" in caplog.text

    missing = ARTLLM(model="no-such-model", api_base=f"{tiny_server.base_url}/v1", max_retries=0)
    async with art_capture() as trajectory:
        with pytest.raises(openai.NotFoundError):
            await missing.achat([ChatMessage(role="user", content="hi")])
        await tiny_llm.acomplete("a chat model's complete() is a chat call too")
    assert trajectory.logs[0].startswith("model call failed: NotFoundError")
    assert roles(trajectory) == ["user", "choice"] and has_tokens(trajectory)


async def test_handler_on_a_plain_openai_like(tiny_server: ServerThread, clean_dispatcher: None) -> None:
    llm = OpenAILike(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", api_key="unused",
                     is_chat_model=True, is_function_calling_model=True, max_tokens=40, timeout=600,
                     additional_kwargs={"extra_body": {"return_token_ids": True}})
    handler = instrument()
    assert instrument() is handler  # idempotent
    get_dispatcher().add_event_handler(ARTEventHandler())  # a second handler, added by hand
    async with art_capture() as trajectory:
        await function_agent(llm).run("weather in Oslo?")
    assert trajectory.metrics["model_calls"] == 2, "each call is recorded once, however many handlers"
    assert roles(trajectory) == ["user", "choice", "tool", "choice"] and has_tokens(trajectory)
    assert trajectory.choices()[0].message["tool_calls"]

    plain = OpenAILike(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", api_key="unused",
                       is_chat_model=True, max_tokens=4)  # no setting at all: art-backend sends the token ids unasked
    with art_capture() as unasked:
        plain.chat([ChatMessage(role="user", content="hi")])
    assert unasked.choices()[0].token_ids and "capture_errors" not in unasked.metrics

    refused = OpenAILike(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", api_key="unused",
                         is_chat_model=True, max_tokens=4,
                         additional_kwargs={"extra_body": {"return_token_ids": False}})  # the gap is reported
    with art_capture() as missing:
        refused.chat([ChatMessage(role="user", content="hi")])
    assert missing.metrics["capture_errors"] == 1 and "return_token_ids" in missing.logs[0]


async def test_the_drop_in_alone_records_only_its_own_calls(tiny_server: ServerThread, other_server: ServerThread,
                                                            clean_dispatcher: None) -> None:
    art = ARTLLM(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", max_tokens=8)
    # say, a judge on another OpenAI-compatible server: not the policy (one on the backend itself
    # would be recorded where the openai SDK sends it, unless made inside `no_capture()`)
    other = OpenAILike(model="tiny-random-smollm2", api_base=f"{other_server.base_url}/v1", api_key="unused",
                       is_chat_model=True, max_tokens=8)
    async with art_capture() as trajectory:
        await other.achat([ChatMessage(role="user", content="judge this")])
        await art.achat([ChatMessage(role="user", content="policy")])
    assert trajectory.metrics == {"model_calls": 1} and trajectory.messages()[0]["content"] == "policy"


async def test_a_captured_agent_trajectory_trains_one_step(tmp_path: Path) -> None:
    async with tiny_backend(tmp_path) as backend:
        model = TrainableModel(name="agent", project="llamaindex")
        await model.register(backend)
        agent = function_agent(ARTLLM.from_model(model, max_tokens=40))
        trajectories = []
        for reward in (0.0, 1.0):
            async with art_capture() as trajectory:
                await agent.run("weather in Lima?")
            trajectory.reward = reward
            trajectories.append(trajectory)
        result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1
    # the random tiny model picks odd token splits that re-rendering does not reproduce:
    # each such turn starts a new sequence, and is counted
    assert result.metrics["sequences"] == 2 + result.metrics["prefix_breaks"]
