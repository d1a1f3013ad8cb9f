"""A scripted expert for the city-facts task: demonstrations for an SFT warm start (`--sft-demos N`),
standing in for a stronger model's traces.

It does the job as the system prompt asks: the tool the question needs, called with the city the
question names, then one plain sentence that says the part of the fact asked for. Each
demonstration is the conversation the agent would have had (its system prompt, its tools, the
tool's real output), as OpenAI chat messages without token ids: `train_sft` renders them with the
served model's chat template and tool-call markup.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.utils.function_calling import convert_to_openai_tool

from art_integrations import Trajectory
from examples.city_facts.agent import SYSTEM_PROMPT, TOOLS
from examples.city_facts.task import Scenario, fact_parts


def answer(scenario: Scenario) -> str:
    """One sentence with the part of the fact the question asks for, in plain words."""
    parts = fact_parts(scenario.tool, scenario.city)
    if scenario.tool == "get_weather":
        if scenario.asks == ("sky",):
            return f"It is {parts['sky']} in {scenario.city} right now."
        return f"It is {parts['temperature']} degrees and {parts['sky']} in {scenario.city}."
    if scenario.tool == "get_local_time":
        return f"The local time in {scenario.city} is {parts['time']}."
    return f"About {parts['population']} million people live in {scenario.city}."


def demonstration(scenario: Scenario) -> Trajectory:
    """The expert's conversation on `scenario`, scored 1 by the task's reward."""
    tools = {t.name: t for t in TOOLS}
    call = {"id": "call_0", "type": "function",
            "function": {"name": scenario.tool, "arguments": json.dumps({"city": scenario.city})}}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": scenario.question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": tools[scenario.tool].invoke({"city": scenario.city})},
        {"role": "assistant", "content": answer(scenario)},
    ]
    return Trajectory(messages_and_choices=messages, tools=[convert_to_openai_tool(t) for t in TOOLS],
                      reward=1.0, metadata={"scenario": scenario.id, "source": "scripted expert"})


def demonstrations(scenarios: Sequence[Scenario]) -> list[Trajectory]:
    return [demonstration(scenario) for scenario in scenarios]
