"""Agents of other frameworks as their docs write them, shared by the tests that run them under each
openai SDK major (tests/test_agent_frameworks.py in .venv, tests/clients/ under the newest). Imported
only where the framework is installed."""

from typing import Any, Literal

import pydantic_ai
from pydantic_ai import RunContext


def pydantic_ai_triage(policy: Any) -> pydantic_ai.Agent:
    """A triage agent whose one way to answer is an output function that asks a researcher agent: a
    run is the triage's call of `research` and, in a history of its own, the researcher's answer.
    (No `from __future__ import annotations` here: PydanticAI reads the function's annotations.)"""
    researcher = pydantic_ai.Agent(policy, instructions="Say what time it is.", model_settings={"max_tokens": 8})

    async def research(ctx: RunContext[None], topic: Literal["time", "date"]) -> str:
        """Ask the researcher about the topic."""
        return (await researcher.run(f"What is the {topic}?", usage=ctx.usage)).output

    return pydantic_ai.Agent(policy, instructions="Ask the researcher.", output_type=[research],
                             model_settings={"max_tokens": 40})
