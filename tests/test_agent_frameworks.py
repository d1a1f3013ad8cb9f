"""Agents of other frameworks, written as their own docs write them, with only their base URL
pointed at the backend: each rollout is captured at the openai SDK's transport, grouped, scored
and trained one step; a handoff or a sub-agent lands as an additional history, as a LangGraph
sub-agent does. Against the tiny model: a forced tool choice (the backend's grammar) makes the
random model call the tool the test needs."""

from __future__ import annotations

import json
from collections.abc import Iterator

import agents
import pytest
from agents import ModelSettings, Runner, function_tool, set_tracing_disabled
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from art_integrations import (
    LocalBackend,
    TrainableModel,
    Trajectory,
    TrajectoryGroup,
    art_capture,
)
from art_integrations.gather import gather_trajectory_groups
from art_integrations.training import TrainConfig
from tests.clients.framework_agents import pydantic_ai_triage
from tests.conftest import tiny_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBackend]:
    running = tiny_backend(tmp_path_factory.mktemp("art"))
    yield running
    running.stop()


def trained_histories(trajectory: Trajectory) -> list[int]:
    """How many model turns each history holds, every one with its exact tokens."""
    for history in trajectory.histories():
        assert all(c.token_ids and c.prompt_token_ids and c.token_logprobs for c in history.choices())
    assert not trajectory.logs, trajectory.logs
    return [len(history.choices()) for history in trajectory.histories()]


async def train_one_step(model: TrainableModel, trajectories: list[Trajectory]) -> None:
    result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1


async def test_openai_agents_sdk_with_a_handoff(backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    model = TrainableModel(name="agents-sdk", project="frameworks")
    await model.register(backend)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{backend.base_url}/v1")  # the one setting that points it here
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    set_tracing_disabled(True)  # its traces would go to OpenAI's own servers

    @function_tool
    def current_time() -> str:
        """The time now."""
        return "12:00"

    researcher = agents.Agent(name="researcher", instructions="Answer with the time.", model=model.inference_name,
                              tools=[current_time],
                              model_settings=ModelSettings(tool_choice="current_time", max_tokens=40))
    triage = agents.Agent(name="triage", instructions="Hand the question to the researcher.",
                          model=model.inference_name, handoffs=[researcher],
                          model_settings=ModelSettings(tool_choice="transfer_to_researcher", max_tokens=40))

    async def rollout(reward: float) -> Trajectory:
        async with art_capture() as trajectory:
            result = await Runner.run(triage, "What time is it?", max_turns=4)
        assert result.last_agent is researcher
        trajectory.reward = reward
        return trajectory

    (group,) = await gather_trajectory_groups([TrajectoryGroup(rollout(r) for r in (0.0, 1.0))], progress=False)
    for trajectory in group.trajectories:
        # triage's handoff; then the researcher's tool call and answer, one conversation of its own
        assert trained_histories(trajectory) == [1, 2]
        assert trajectory.messages()[-1]["tool_calls"][0]["function"]["name"] == "transfer_to_researcher"
    await train_one_step(model, group.trajectories)


async def test_pydantic_ai_with_a_sub_agent(backend: LocalBackend) -> None:
    model = TrainableModel(name="pydantic-ai", project="frameworks")
    await model.register(backend)
    policy = OpenAIChatModel(model.inference_name, provider=OpenAIProvider(base_url=f"{backend.base_url}/v1",
                                                                          api_key="unused"))
    triage = pydantic_ai_triage(policy)  # its one way to answer: ask the researcher

    async def rollout(reward: float) -> Trajectory:
        async with art_capture() as trajectory:
            await triage.run("What time is it?")
        trajectory.reward = reward
        return trajectory

    (group,) = await gather_trajectory_groups([TrajectoryGroup(rollout(r) for r in (0.0, 1.0))], progress=False)
    for trajectory in group.trajectories:
        assert trained_histories(trajectory) == [1, 1]  # triage's call of `research`; the researcher's answer
        (call,) = trajectory.messages()[-1]["tool_calls"]  # PydanticAI names its output tool final_result
        assert json.loads(call["function"]["arguments"])["topic"] in ("time", "date")
    await train_one_step(model, group.trajectories)
