"""Scenarios and the reward for the unit-conversion agent.

Each scenario asks to convert one quantity (a length, a weight or a temperature). The agent
must call the matching conversion tool with the question's value and units, then answer with
the number the tool returned, in plain words. The reward gives partial credit for each part,
so rollouts of the small base model score differently within a group (the signal GRPO learns
from). Held-out questions use values never seen in training.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# metres / grams per unit
LENGTHS = {"millimetre": 0.001, "centimetre": 0.01, "metre": 1.0, "kilometre": 1000.0, "inch": 0.0254,
           "foot": 0.3048, "yard": 0.9144, "mile": 1609.344}
WEIGHTS = {"gram": 1.0, "kilogram": 1000.0, "ounce": 28.349523125, "pound": 453.59237}
TEMPERATURES = ("celsius", "fahrenheit")
TOOL_OF_KIND = {"length": "convert_length", "weight": "convert_weight", "temperature": "convert_temperature"}

PLURALS = {"millimetre": "millimetres", "centimetre": "centimetres", "metre": "metres", "kilometre": "kilometres",
           "inch": "inches", "foot": "feet", "yard": "yards", "mile": "miles", "gram": "grams",
           "kilogram": "kilograms", "ounce": "ounces", "pound": "pounds", "celsius": "degrees Celsius",
           "fahrenheit": "degrees Fahrenheit"}
CONVERSIONS = {  # the pairs people ask about
    "length": [("inch", "centimetre"), ("centimetre", "inch"), ("foot", "metre"), ("metre", "foot"),
               ("mile", "kilometre"), ("kilometre", "mile"), ("yard", "metre"), ("millimetre", "inch")],
    "weight": [("kilogram", "pound"), ("pound", "kilogram"), ("ounce", "gram"), ("gram", "ounce")],
    "temperature": [("celsius", "fahrenheit"), ("fahrenheit", "celsius")],
}
QUESTIONS = ["How many {to} are {value} {frm}?", "Convert {value} {frm} to {to}.", "What is {value} {frm} in {to}?"]


def convert(kind: str, value: float, from_unit: str, to_unit: str) -> float:
    if kind == "temperature":
        if from_unit == to_unit:
            return value
        return value * 9 / 5 + 32 if from_unit == "celsius" else (value - 32) * 5 / 9
    table = LENGTHS if kind == "length" else WEIGHTS
    return value * table[from_unit] / table[to_unit]


def format_number(value: float) -> str:
    """Two decimals at most, no trailing zeros: 17.78, 86, 0.5."""
    return f"{value:.2f}".rstrip("0").rstrip(".")


@dataclass(frozen=True)
class Scenario:
    id: str
    question: str
    kind: str  # length, weight or temperature
    value: int
    from_unit: str
    to_unit: str

    @property
    def tool(self) -> str:
        return TOOL_OF_KIND[self.kind]

    @property
    def answer(self) -> str:
        """The converted number, as the tool prints it."""
        return format_number(convert(self.kind, self.value, self.from_unit, self.to_unit))


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    """Train and held-out scenarios use disjoint values, so held-out scores measure generalisation."""
    values = range(2, 60) if split == "train" else range(60, 100)  # held-out values are never trained on
    rng = random.Random(f"{split}-{seed}")
    out = []
    for i in range(count):
        kind = rng.choice(sorted(CONVERSIONS))
        from_unit, to_unit = rng.choice(CONVERSIONS[kind])
        value = rng.choice(values)
        question = rng.choice(QUESTIONS).format(value=value, frm=PLURALS[from_unit], to=PLURALS[to_unit])
        out.append(Scenario(f"{split}-{i}", question, kind, value, from_unit, to_unit))
    return out


def score(scenario: Scenario, tool_calls: list[tuple[str, dict]], final_answer: str) -> dict[str, float]:
    """Partial credit, one part at a time: the right tool (0.2), the question's value (0.2), the
    right units (0.1 each way), an answer that carries the converted number (0.2), in plain
    words rather than echoed markup (0.2)."""
    right_tool = any(name == scenario.tool for name, _ in tool_calls)
    right_value = any(args.get("value") == scenario.value for _, args in tool_calls)
    right_units = max((0.5 * (args.get("from_unit") == scenario.from_unit)
                       + 0.5 * (args.get("to_unit") == scenario.to_unit) for _, args in tool_calls), default=0.0)
    has_number = scenario.answer in final_answer
    plain = bool(final_answer.strip()) and "<" not in final_answer
    return {"right_tool": float(right_tool), "right_value": float(right_value), "right_units": right_units,
            "has_number": float(has_number), "plain": float(plain),
            "reward": 0.2 * right_tool + 0.2 * right_value + 0.2 * right_units + 0.2 * has_number + 0.2 * plain}
