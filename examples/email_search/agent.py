"""The agent, written as a LangGraph user writes one: three tools over the user's inbox, a model
node and a tool node, at most four model calls.

The only ART-specific line is the chat model the caller passes in (`ChatART`). Every turn is a
tool call (the final answer is a tool too), so every turn sets `tool_choice`: search first,
then read, then read more or answer, and answer at the latest on the fourth call. A small
model never emits a tool call on its own; with `tool_choice` the backend guarantees one, and
the argument schemas (lengths, the message ids' shape) bound what goes into it, so each call
stays within a few dozen tokens.
"""

from __future__ import annotations

from typing import Annotated, Any

from langchain_core.messages import SystemMessage
from langchain_core.tools import BaseTool, tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import BaseModel, Field

from examples.email_search.inbox import read, search

SYSTEM_PROMPT = ("You answer questions about the user's emails. First call search_inbox with words from the "
                 "question. Then call read_email with a message_id from the search results. Then call "
                 "return_final_answer with the short answer and that message_id as the source.")


# The shape of this inbox's ids: a constraining backend only lets the model write ids of this
# shape (whether the id exists is up to the model); other endpoints' calls are validated.
MessageId = Annotated[str, Field(pattern=r"^M[0-9]{5}$")]


class SearchInbox(BaseModel):
    keywords: str = Field(description="words from the question, e.g. 'budget meeting'", max_length=60)


class ReadEmail(BaseModel):
    message_id: MessageId = Field(description="a message_id from the search results")


class FinalAnswer(BaseModel):
    answer: str = Field(description="the answer, as short as possible", max_length=60)
    sources: list[MessageId] = Field(description="message_id of the email the answer comes from", max_length=2)


def inbox_tools(inbox: str) -> list[BaseTool]:
    """The three tools, bound to one user's inbox."""

    @tool(args_schema=SearchInbox)
    def search_inbox(keywords: str) -> str:
        """Search the inbox. Returns up to 3 emails: message_id, subject and a snippet."""
        hits = search(inbox, keywords)
        return "\n".join(f"message_id {h.message_id}: {h.subject} ({h.snippet})" for h in hits) or "No emails found."

    @tool(args_schema=ReadEmail)
    def read_email(message_id: str) -> str:
        """Read one email."""
        email = read(inbox, message_id)
        if email is None:
            return f"No email has message_id {message_id!r}. Use a message_id from the search results."
        return (f"message_id {email.message_id}\nFrom: {email.sender}\nDate: {email.date}\nSubject: {email.subject}\n\n"
                f"{email.body}")

    @tool(args_schema=FinalAnswer)
    def return_final_answer(answer: str, sources: list[str]) -> str:
        """Give the user the final answer and the message_id of the email it comes from."""
        return "Answer sent."

    return [search_inbox, read_email, return_final_answer]


# What each model call must do. A 135M model left to choose repeats its first search every turn.
TOOL_CHOICE_PER_CALL = ["search_inbox", "read_email", "required", "return_final_answer"]


def build_agent(llm: Any, tools: list[BaseTool]) -> Any:
    # The same tools on every call, so each turn's prompt extends the last one's tokens.
    models = [llm.bind_tools(tools, tool_choice=choice, parallel_tool_calls=False) for choice in TOOL_CHOICE_PER_CALL]

    async def call_model(state: MessagesState) -> dict[str, Any]:
        calls = sum(m.type == "ai" for m in state["messages"])
        return {"messages": [await models[calls].ainvoke([SystemMessage(SYSTEM_PROMPT), *state["messages"]])]}

    def answered(state: MessagesState) -> str:
        last_call = next(m for m in reversed(state["messages"]) if m.type == "ai")
        return END if any(c["name"] == "return_final_answer" for c in last_call.tool_calls) else "agent"

    graph = StateGraph(MessagesState)
    graph.add_node("agent", call_model)
    graph.add_node("tools", ToolNode(tools))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)  # no tool call (a model that ignores tool_choice): stop
    graph.add_conditional_edges("tools", answered, ["agent", END])
    return graph.compile()
