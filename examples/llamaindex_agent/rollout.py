"""One rollout: run the LlamaIndex agent on a scenario inside `art_capture()` and score it."""

from __future__ import annotations

from art_integrations import Trajectory, art_capture
from examples.llamaindex_agent.agent import build_agent
from examples.llamaindex_agent.task import Scenario, scenarios, score
from examples.runner import Example, Policy


async def rollout(policy: Policy, scenario: Scenario) -> Trajectory:
    agent = build_agent(policy.llamaindex())
    async with art_capture(scenario=scenario.id) as trajectory:
        output = await agent.run(scenario.question, max_iterations=4)
    tool_calls = [(call.tool_name, call.tool_kwargs) for call in output.tool_calls]
    parts = score(scenario, tool_calls, str(output.response.content or ""))
    trajectory.reward = parts.pop("reward")
    trajectory.metrics.update(parts)
    return trajectory


EXAMPLE = Example(
    project="llamaindex-units",
    model_prefix="units-agent",
    title="LlamaIndex unit-conversion agent",
    scenarios=scenarios,
    rollout=rollout,
    metrics=("right_tool", "right_units", "has_number", "plain"),
)
