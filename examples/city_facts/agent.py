"""The agent, written as a LangGraph user writes one: tools, a model node, a tool node.

The only ART-specific line is the chat model: `ChatART.from_model(model)` instead of
`ChatOpenAI(...)`. The agent must look the fact up before answering, so its first turn
requires a tool call (`tool_choice="required"`); afterwards it answers in words.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from langchain_core.messages import SystemMessage
from langchain_core.tools import BaseTool, StructuredTool, tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.city_facts.task import CITIES, fact

SYSTEM_PROMPT = "You answer questions about cities. Look the fact up with a tool, then answer in one sentence."

# The cities the tools know, as an enum: the backend's grammar then spells them exactly, and
# picking the one the question names is part of what the policy learns.
City = Literal[tuple(CITIES)]  # type: ignore[valid-type]


@tool
def get_weather(city: City) -> str:
    """Current weather in a city."""
    return fact("get_weather", city)


@tool
def get_local_time(city: City) -> str:
    """Current local time in a city."""
    return fact("get_local_time", city)


@tool
def get_population(city: City) -> str:
    """Population of a city."""
    return fact("get_population", city)


TOOLS = [get_weather, get_local_time, get_population]


def answering_after(lookup: BaseTool, seconds: float) -> BaseTool:
    """`lookup` as a remote service answers it: after `seconds` (a web API, a database), waited
    without blocking, so other rollouts decode meanwhile (`--tool-seconds`)."""
    async def call(**arguments: Any) -> str:
        await asyncio.sleep(seconds)
        return lookup.invoke(arguments)

    return StructuredTool.from_function(coroutine=call, name=lookup.name, description=lookup.description,
                                        args_schema=lookup.args_schema)


def build_agent(llm: Any, tool_seconds: float = 0.0) -> Any:
    tools = [answering_after(t, tool_seconds) for t in TOOLS] if tool_seconds else TOOLS
    must_call = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False)
    answer = llm.bind_tools(tools, tool_choice="none")

    async def call_model(state: MessagesState) -> dict[str, Any]:
        looked_up = any(m.type == "tool" for m in state["messages"])
        reply = await (answer if looked_up else must_call).ainvoke([SystemMessage(SYSTEM_PROMPT), *state["messages"]])
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()
