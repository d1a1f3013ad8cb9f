"""One rollout: run the supervisor on a scenario inside `art_capture()` and score both agents.

The sub-agent's conversation is not in the supervisor's messages (it only sees the report);
it is in the captured trajectory, as the additional history of the `research` node. The
reward reads the sub-agent's tool calls from there, and the rollout records how many times the
supervisor delegated and how many sub-agent conversations were captured for training.
"""

from __future__ import annotations

import json
from typing import Any

from art_integrations import History, Trajectory, art_capture
from examples.runner import Example, Policy
from examples.supervisor.agent import RESEARCH_NODE, build_supervisor
from examples.supervisor.task import Scenario, scenarios, score


def sub_agent_histories(trajectory: Trajectory) -> list[History]:
    """The captured conversations of the research sub-agent (each additional history is named by
    the agent it came from in `metadata["additional_history_agents"]`)."""
    agents = trajectory.metadata.get("additional_history_agents", [])
    return [history for history, agent in zip(trajectory.additional_histories, agents) if agent == RESEARCH_NODE]


def tool_calls(history: History) -> list[tuple[str, dict[str, Any]]]:
    return [(call["function"]["name"], json.loads(call["function"]["arguments"]))
            for message in history.messages() if message.get("role") == "assistant"
            for call in message.get("tool_calls") or []]


async def rollout(policy: Policy, scenario: Scenario) -> Trajectory:
    agent = build_supervisor(policy.langchain())
    async with art_capture(scenario=scenario.id) as trajectory:
        result = await agent.ainvoke({"messages": [("user", scenario.question)]})
    messages = result["messages"]
    requests = [call["args"] for m in messages if m.type == "ai" for call in m.tool_calls]
    research = sub_agent_histories(trajectory)
    last = messages[-1]
    final_answer = last.content if last.type == "ai" and not last.tool_calls and isinstance(last.content, str) else ""
    parts = score(scenario, requests, [call for history in research for call in tool_calls(history)], final_answer)
    trajectory.reward = parts.pop("reward")
    trajectory.metrics.update(parts)
    # every delegation should have left a sub-agent conversation to train on
    trajectory.metrics.update(sub_agent_calls=len(requests), sub_agent_histories=len(research))
    if len(research) != len(requests):
        trajectory.logs.append(f"{len(requests)} delegations but {len(research)} sub-agent histories captured")
    return trajectory


EXAMPLE = Example(
    project="supervisor",
    model_prefix="shop-supervisor",
    title="supervisor + research sub-agent",
    scenarios=scenarios,
    rollout=rollout,
    metrics=("right_request", "right_lookup", "has_number", "plain", "sub_agent_histories"),
    temperature=0.7,
)
