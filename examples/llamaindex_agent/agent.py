"""The agent, written as a LlamaIndex user writes one: plain functions as tools and a FunctionAgent.

The only ART-specific line is the LLM passed in: `ARTLLM.from_model(model)` (here
`policy.llamaindex()`) instead of `OpenAI(...)`. The agent must convert before it answers, so
its first turn requires a tool call (`initial_tool_choice="required"`, which the backend
enforces by constrained decoding); afterwards the model chooses, and answers in words.
"""

# No `from __future__ import annotations`: LlamaIndex reads the tools' annotations at runtime.
from typing import Any, Literal

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.tools import FunctionTool

from examples.llamaindex_agent.task import LENGTHS, TEMPERATURES, WEIGHTS, convert, format_number

SYSTEM_PROMPT = "You convert units with a tool, then give the result in one sentence."

# Units as enums: the tool schema lists them, and the backend's grammar spells them exactly.
LengthUnit = Literal[tuple(LENGTHS)]  # type: ignore[valid-type]
WeightUnit = Literal[tuple(WEIGHTS)]  # type: ignore[valid-type]
TemperatureUnit = Literal[TEMPERATURES]  # type: ignore[valid-type]


def convert_length(value: float, from_unit: LengthUnit, to_unit: LengthUnit) -> str:
    """Convert a length from one unit to another."""
    converted = format_number(convert("length", value, from_unit, to_unit))
    return f"{format_number(value)} {from_unit} = {converted} {to_unit}"


def convert_weight(value: float, from_unit: WeightUnit, to_unit: WeightUnit) -> str:
    """Convert a weight from one unit to another."""
    converted = format_number(convert("weight", value, from_unit, to_unit))
    return f"{format_number(value)} {from_unit} = {converted} {to_unit}"


def convert_temperature(value: float, from_unit: TemperatureUnit, to_unit: TemperatureUnit) -> str:
    """Convert a temperature between Celsius and Fahrenheit."""
    converted = format_number(convert("temperature", value, from_unit, to_unit))
    return f"{format_number(value)} {from_unit} = {converted} {to_unit}"


TOOLS = [FunctionTool.from_defaults(fn) for fn in (convert_length, convert_weight, convert_temperature)]


def build_agent(llm: Any) -> FunctionAgent:
    # one call per turn; if the model ever keeps calling tools, the run stops after a few turns
    # with a final answer instead of an error (`early_stopping_method="generate"`)
    return FunctionAgent(tools=TOOLS, llm=llm, system_prompt=SYSTEM_PROMPT, initial_tool_choice="required",
                         allow_parallel_tool_calls=False, early_stopping_method="generate")
