"""One rollout: run the agent on a scenario inside `art_capture()` and score it."""

from __future__ import annotations

import statistics
from typing import Any

from art_integrations import Trajectory, art_capture
from examples.city_facts.task import Scenario, score


async def rollout(agent: Any, scenario: Scenario) -> Trajectory:
    async with art_capture(scenario=scenario.id) as trajectory:
        result = await agent.ainvoke({"messages": [("user", scenario.question)]})
    messages = result["messages"]
    tool_calls = [(call["name"], call["args"]) for m in messages if m.type == "ai" for call in m.tool_calls]
    last = messages[-1]
    final_answer = last.content if last.type == "ai" and not last.tool_calls and isinstance(last.content, str) else ""
    parts = score(scenario, tool_calls, final_answer)
    trajectory.reward = parts.pop("reward")
    trajectory.metrics.update(parts)
    return trajectory


async def evaluate(agent: Any, scenarios: list[Scenario]) -> tuple[float, list[Trajectory]]:
    """Mean reward of one rollout per scenario (run the agent greedily for a stable score)."""
    import asyncio

    trajectories = list(await asyncio.gather(*(rollout(agent, s) for s in scenarios)))
    return statistics.fmean(t.reward for t in trajectories), trajectories
