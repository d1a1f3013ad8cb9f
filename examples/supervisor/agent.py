"""A supervisor and its sub-agent, written as a LangGraph user writes them.

The shop's assistant (the supervisor) does not see the catalogue: it has one tool,
`ask_researcher(product, topic)`, that puts the question to a research sub-agent, a compiled
graph with its own model node and catalogue tools, and returns what the sub-agent found. The
sub-agent runs inside the supervisor's `research` tool node, so LangGraph runs it as a subgraph
(its own checkpoint namespace), and `art_capture()` records its model calls as a separate
conversation: an additional history of the rollout's trajectory, trained along with the
supervisor's.

Sized for a 135M model: the request is typed (product and topic as enums) because its sampled
free-text questions named the product in only a third to a half of the rollouts; and the
catalogue's answer is the sub-agent's report, returned as is (a tool's `return_direct`),
because its own re-wording mostly lost the number before the supervisor saw it.

The only ART-specific line is the chat model passed in: `ChatART.from_model(model)` instead of
`ChatOpenAI(...)`. Both agents must act before they talk, so each one's first turn requires a
tool call (`tool_choice="required"`); afterwards the supervisor answers in words.
"""

from __future__ import annotations

from typing import Any, Literal

from langchain_core.messages import SystemMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.supervisor.task import PRODUCTS, TOPICS, fact

SUPERVISOR_PROMPT = ("You are the shop's assistant. Ask the researcher about the product the customer asks about, "
                     "then answer the customer in one sentence.")
RESEARCHER_PROMPT = "You look products up in the shop's catalogue with the tool that answers the question."
RESEARCH_NODE = "research"  # the supervisor's tool node; the sub-agent's calls are captured under this name

# Product names and request topics as enums: the backend's grammar then spells them exactly.
Product = Literal[PRODUCTS]  # type: ignore[valid-type]
Topic = Literal[tuple(TOPICS)]  # type: ignore[valid-type]
RESEARCH_QUESTIONS = {"price": "How much does the {product} cost?", "stock": "How many of the {product} are in stock?",
                      "delivery": "How many days does delivery of the {product} take?"}


@tool
def get_price(product: Product) -> str:
    """Price of a product in the shop's catalogue."""
    return fact("get_price", product)


@tool
def get_stock(product: Product) -> str:
    """How many units of a product are in stock."""
    return fact("get_stock", product)


@tool
def get_delivery_days(product: Product) -> str:
    """How many days delivery of a product takes."""
    return fact("get_delivery_days", product)


CATALOGUE_TOOLS = [get_price, get_stock, get_delivery_days]


def build_research_agent(llm: Any) -> Any:
    """The sub-agent: looks the fact up with a catalogue tool; the tool's answer ends the run."""
    look_up = llm.bind_tools(CATALOGUE_TOOLS, tool_choice="required", parallel_tool_calls=False)

    async def researcher(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await look_up.ainvoke([SystemMessage(RESEARCHER_PROMPT), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("researcher", researcher)
    graph.add_node("catalogue", ToolNode(CATALOGUE_TOOLS))
    graph.add_edge(START, "researcher")
    graph.add_conditional_edges("researcher", tools_condition, {"tools": "catalogue", END: END})
    graph.add_edge("catalogue", END)  # the catalogue's answer is the report
    return graph.compile(name="research_agent")


def build_supervisor(llm: Any) -> Any:
    """The supervisor: delegates the lookup to the research sub-agent, then answers the customer."""
    research_agent = build_research_agent(llm)

    @tool
    async def ask_researcher(product: Product, topic: Topic) -> str:
        """Ask the research assistant about a product in the shop's catalogue: its price, stock or delivery time."""
        question = RESEARCH_QUESTIONS[topic].format(product=product)
        result = await research_agent.ainvoke({"messages": [("user", question)]})
        return result["messages"][-1].content  # what the catalogue answered

    must_delegate = llm.bind_tools([ask_researcher], tool_choice="required", parallel_tool_calls=False)
    answer = llm.bind_tools([ask_researcher], tool_choice="none")

    async def supervisor(state: MessagesState) -> dict[str, Any]:
        researched = any(m.type == "tool" for m in state["messages"])
        model = answer if researched else must_delegate
        return {"messages": [await model.ainvoke([SystemMessage(SUPERVISOR_PROMPT), *state["messages"]])]}

    graph = StateGraph(MessagesState)
    graph.add_node("supervisor", supervisor)
    graph.add_node(RESEARCH_NODE, ToolNode([ask_researcher]))
    graph.add_edge(START, "supervisor")
    graph.add_conditional_edges("supervisor", tools_condition, {"tools": RESEARCH_NODE, END: END})
    graph.add_edge(RESEARCH_NODE, "supervisor")
    return graph.compile()
