"""Agents as their own docs write them, under today's newest openai SDK (3.x) and only their base URL
pointed at `art-backend serve`: a bare `requests` tool loop, a DSPy `ReAct` program (DSPy calls models
through LiteLLM) and a PydanticAI agent with a sub-agent, each captured with the exact tokens the
backend produced, grouped, scored and trained one step. The tiny model's words are noise, so each
rollout's reward is the test's (0 or 1): what is checked is that the calls reach training."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import requests

from art_integrations import (
    RemoteBackend,
    TrainableModel,
    Trajectory,
    TrajectoryGroup,
    art_capture,
)
from art_integrations.gather import gather_trajectory_groups
from art_integrations.training import TrainConfig

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather in a city",
                 "parameters": {"type": "object", "required": ["city"],
                                "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}}},
}


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"18 C and sunny in {city}"


async def registered(backend_url: str, name: str) -> TrainableModel:
    model = TrainableModel(name=name, project="clients")
    await model.register(RemoteBackend(backend_url))
    return model


async def captured_grouped_and_trained(model: TrainableModel, run: Callable[[], Awaitable[Any]]) -> list[Trajectory]:
    """Two rollouts of `run` (rewards 0 and 1), each in its capture, gathered as one group and trained
    a step; the trajectories, each checked to hold only calls with exact tokens."""

    async def rollout(reward: float) -> Trajectory:
        async with art_capture() as trajectory:
            await run()
        trajectory.reward = reward
        return trajectory

    (group,) = await gather_trajectory_groups([TrajectoryGroup(rollout(r) for r in (0.0, 1.0))], progress=False)
    for trajectory in group.trajectories:
        assert not trajectory.logs, trajectory.logs
        turns = [choice for history in trajectory.histories() for choice in history.choices()]
        assert turns and trajectory.metrics["model_calls"] == len(turns)
        assert all(t.token_ids and t.prompt_token_ids and len(t.token_logprobs or []) == len(t.token_ids)
                   for t in turns)
    result = await model.train([group], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1
    return group.trajectories


async def test_a_bare_requests_tool_loop_is_captured_grouped_and_trained(backend_url: str) -> None:
    """The loop a user writes without a framework: POST the conversation, run the tool it calls, POST
    again with the result; the second call continues the first, so each rollout is one history."""
    model = await registered(backend_url, "requests-loop")

    def agent(question: str) -> str:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for turn in range(2):
            body = {"model": model.inference_name, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 64,
                    "tool_choice": "required" if turn == 0 else "none"}
            reply = requests.post(f"{backend_url}/v1/chat/completions", json=body, timeout=120)
            reply.raise_for_status()
            message = reply.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                result = get_weather(**json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return messages[-1]["content"] or ""

    trajectories = await captured_grouped_and_trained(model, lambda: asyncio.to_thread(agent, "Weather in Oslo?"))
    for trajectory in trajectories:
        assert [len(history.choices()) for history in trajectory.histories()] == [2]
        assert [m["role"] for m in trajectory.messages()] == ["user", "assistant", "tool", "assistant"]
        assert trajectory.messages()[1]["tool_calls"][0]["function"]["name"] == "get_weather"


@pytest.mark.skipif(importlib.util.find_spec("dspy") is None, reason="dspy did not install here")
async def test_a_dspy_react_program_is_captured_grouped_and_trained(backend_url: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """DSPy's ReAct on `dspy.LM("openai/<model>", api_base=...)` with `engine="litellm"`: its calls go
    through LiteLLM, which posts with httpx. DSPy caches replies by default (cache=False keeps each
    rollout a new sample); the random model's replies rarely parse as DSPy's fields, which DSPy raises
    after its retries, and the rollout keeps what was called."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of LiteLLM's price list at import
    import dspy

    model = await registered(backend_url, "dspy-react")
    lm = dspy.LM(f"openai/{model.inference_name}", api_base=f"{backend_url}/v1", api_key="unused",
                 max_tokens=32, temperature=1.0, cache=False, engine="litellm")
    program = dspy.ReAct("question -> answer", tools=[get_weather], max_iters=2)

    async def run() -> None:
        with dspy.context(lm=lm):
            try:
                await program.acall(question="Weather in Paris?")
            except dspy.utils.exceptions.AdapterParseError:
                pass  # the reply's fields did not parse: still a rollout, scored by its reward

    await captured_grouped_and_trained(model, run)


@pytest.mark.skipif(importlib.util.find_spec("dspy") is None, reason="dspy did not install here")
async def test_dspy_on_its_own_transport_is_not_seen_and_the_warning_names_the_fix(
        backend_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DSPy's default engine (lm15) opens its own sockets, which no HTTP client patch sees: the calls
    are served, the capture records none and says to pass engine="litellm"."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import dspy

    lm = dspy.LM("openai/tiny-random-smollm2", api_base=f"{backend_url}/v1", api_key="unused", max_tokens=8,
                 cache=False)
    async with art_capture() as trajectory:
        replies = await lm.acall("hi")
    assert replies and trajectory.metrics["model_calls"] == 0
    assert any('engine="litellm"' in line for line in trajectory.logs), trajectory.logs


@pytest.mark.skipif(importlib.util.find_spec("pydantic_ai") is None, reason="pydantic-ai did not install here")
async def test_a_pydantic_ai_agent_with_a_sub_agent_is_captured_grouped_and_trained(backend_url: str) -> None:
    """PydanticAI on openai 3.x: the triage agent's one way to answer is an output function that asks a
    researcher agent, so each rollout is the triage's call and, in a history of its own, the researcher's."""
    from framework_agents import pydantic_ai_triage
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = await registered(backend_url, "pydantic-ai-3")
    policy = OpenAIChatModel(model.inference_name,
                             provider=OpenAIProvider(base_url=f"{backend_url}/v1", api_key="unused"))
    triage = pydantic_ai_triage(policy)
    trajectories = await captured_grouped_and_trained(model, lambda: triage.run("What time is it?"))
    for trajectory in trajectories:
        assert [len(history.choices()) for history in trajectory.histories()] == [1, 1]


async def test_the_pipeline_trains_what_the_newest_openai_sdk_sends_while_rollouts_run(backend_url: str) -> None:
    """PipelineTrainer through `model.openai_client()`, as ART's scripts call the model, on openai 3.x."""
    import openai

    from art_integrations.pipeline_trainer import PipelineTrainer

    model = await registered(backend_url, "pipelined")

    async def rollout(model: TrainableModel, scenario: int, config: Any) -> TrajectoryGroup:
        async def one(reward: float) -> Trajectory:
            async with art_capture() as trajectory:
                await model.openai_client().chat.completions.create(
                    model=model.get_inference_name(), max_tokens=4, messages=[{"role": "user", "content": f"q{scenario}"}])
            trajectory.reward = reward
            return trajectory

        return await TrajectoryGroup(one(r) for r in (0.0, 1.0))

    trainer = PipelineTrainer(model, model.backend, rollout, range(6), None, min_batch_size=2, max_batch_size=2,
                              max_steps=2, max_steps_off_policy=1, train_config=TrainConfig(learning_rate=1e-3))
    await trainer.train(handle_signals=False)
    assert int(openai.__version__.split(".")[0]) >= 3 and await model.get_step() == 2
    trained = [r for r in await model.history() if r["split"] == "train"]
    assert [r["groups/trained"] for r in trained] == [2, 2] and not trainer.status.dropped
