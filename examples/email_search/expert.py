"""A scripted expert for the email-search task: demonstrations for SFT, standing in for a stronger
model's traces.

It does the job the way the system prompt asks, with the agent's own three tools on the
scenario's inbox: a search with the question's content words (the answering email's subject if
those do not find it), a read of the answering email, and the answer with that email as its
source. Each demonstration is the conversation the agent would have had (the same system prompt
and tools, the tools' real outputs), as OpenAI chat messages without token ids: `train_sft`
renders them with the served model's chat template and tool-call markup.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from langchain_core.utils.function_calling import convert_to_openai_tool

from art_integrations import Trajectory
from examples.email_search.agent import SYSTEM_PROMPT, inbox_tools
from examples.email_search.inbox import read, search
from examples.email_search.task import Scenario

# words a question carries that no email's text is searched for
STOPWORDS = frozenset("a an and are at did do does for from how i in is it me my of on or the to was what when "
                      "where which who why with you your".split())


def search_words(scenario: Scenario) -> str:
    """The question's content words, within the tool's 60 characters; the answering email's subject
    when those do not bring it up."""
    keywords = ""
    for word in (w for w in re.findall(r"[A-Za-z0-9']+", scenario.question) if w.lower() not in STOPWORDS):
        if len(keywords) + 1 + len(word) > 60:
            break
        keywords = f"{keywords} {word}".lstrip()
    if scenario.message_id in {hit.message_id for hit in search(scenario.inbox, keywords)}:
        return keywords
    email = read(scenario.inbox, scenario.message_id)
    assert email is not None, scenario
    return email.subject[:60]


def demonstration(scenario: Scenario) -> Trajectory:
    """The expert's conversation on `scenario`, scored 1 by the task's reward."""
    tools = {t.name: t for t in inbox_tools(scenario.inbox)}
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                      {"role": "user", "content": scenario.question}]
    calls = [("search_inbox", {"keywords": search_words(scenario)}),
             ("read_email", {"message_id": scenario.message_id}),
             ("return_final_answer", {"answer": scenario.answer, "sources": [scenario.message_id]})]
    for i, (name, arguments) in enumerate(calls):
        call_id = f"call_{i}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": str(tools[name].invoke(arguments))})
    return Trajectory(messages_and_choices=messages, tools=[convert_to_openai_tool(t) for t in tools.values()],
                      reward=1.0, metadata={"scenario": scenario.id, "source": "scripted expert"})


def demonstrations(scenarios: Sequence[Scenario]) -> list[Trajectory]:
    return [demonstration(scenario) for scenario in scenarios]
