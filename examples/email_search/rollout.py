"""One rollout: run the agent on a scenario inside `art_capture()` and score what it did."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, ToolMessage

from art_integrations import Trajectory, art_capture
from examples.email_search.agent import build_agent, inbox_tools
from examples.email_search.expert import demonstrations
from examples.email_search.task import Episode, Scenario, scenarios, score
from examples.runner import Example, Policy


def episode_from(messages: Sequence[BaseMessage]) -> Episode:
    """The agent's searches, reads and answer, from the graph's messages. A call the tool rejected
    (its ToolMessage has status "error") or a reply without a tool call counts as malformed."""
    episode = Episode()
    rejected = {m.tool_call_id for m in messages if isinstance(m, ToolMessage) and m.status == "error"}
    for message in messages:
        if not isinstance(message, AIMessage):
            continue
        episode.model_calls += 1
        episode.malformed += (not message.tool_calls) + len(message.invalid_tool_calls)
        for call in message.tool_calls:
            args: dict[str, Any] = call["args"]
            if call["id"] in rejected:
                episode.malformed += 1
            elif call["name"] == "search_inbox":
                episode.searches.append(args["keywords"])
            elif call["name"] == "read_email":
                episode.reads.append(args["message_id"])
            elif call["name"] == "return_final_answer":
                episode.answer, episode.sources = args["answer"], args["sources"]
    return episode


async def rollout(policy: Policy, scenario: Scenario) -> Trajectory:
    agent = build_agent(policy.langchain(), inbox_tools(scenario.inbox))
    async with art_capture(scenario=scenario.id) as trajectory:
        result = await agent.ainvoke({"messages": [("user", scenario.question)]})
    parts = score(scenario, episode_from(result["messages"]))
    trajectory.reward = parts.pop("reward")
    trajectory.metrics.update(parts)
    return trajectory


EXAMPLE = Example(
    project="email-search",
    model_prefix="email-agent",
    title="email-search agent",
    scenarios=scenarios,
    rollout=rollout,
    metrics=("answer_right", "cited_source", "read_email"),
    max_tokens=96,
    demonstrations=demonstrations,
)
