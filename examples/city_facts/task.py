"""Scenarios and the reward for the city-facts agent.

Each scenario asks one fact (weather, local time or population) about one city. The agent
must pick the matching tool with the city as argument, then answer in plain words with the
part of the fact the question asks for (the base model mostly echoes the tool's markup
instead). The reward gives partial credit for each part, so rollouts of the small base model
score differently within a group (the signal GRPO learns from).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Dakar", "Perth",
          "Seoul", "Lagos", "Hanoi", "Accra", "Kyiv", "Riga", "Bern", "Doha", "Baku", "Sofia"]
# Each question with the parts of its tool's fact that answer it (any one of them does): "Is it
# raining?" is answered by the sky, not the temperature, and "How warm is it?" the other way round.
QUESTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "get_weather": {"What is the weather like in {city}?": ("temperature", "sky"),
                    "Is it raining in {city} right now?": ("sky",),
                    "How warm is it in {city} today?": ("temperature",)},
    "get_local_time": {"What time is it in {city}?": ("time",),
                       "Tell me the current local time in {city}.": ("time",),
                       "Is it morning or evening in {city} now?": ("time",)},
    "get_population": {"How many people live in {city}?": ("population",),
                       "What is the population of {city}?": ("population",),
                       "How big is {city} by number of inhabitants?": ("population",)},
}
# How an answer may name the sky: "Is it raining?" is fairly answered "it is raining".
SKY_WORDS = {"sunny": ("sunny",), "cloudy": ("cloudy",), "rainy": ("rainy", "raining")}


def fact_parts(tool: str, city: str) -> dict[str, str]:
    """The parts of a tool's answer: deterministic per city, so rewards can check the final reply."""
    seed = sum(map(ord, city))
    if tool == "get_weather":
        return {"temperature": f"{seed % 30 + 2}", "sky": ["sunny", "cloudy", "rainy"][seed % 3]}
    if tool == "get_local_time":
        return {"time": f"{seed % 12 + 1}:{seed % 6}0"}
    return {"population": f"{seed % 9 + 1}.{seed % 10}"}


def fact(tool: str, city: str) -> str:
    """What the tool returns."""
    parts = fact_parts(tool, city)
    if tool == "get_weather":
        return f"{parts['temperature']} C, {parts['sky']}"
    if tool == "get_local_time":
        return parts["time"]
    return f"{parts['population']} million"


@dataclass(frozen=True)
class Scenario:
    id: str
    question: str
    tool: str
    city: str
    asks: tuple[str, ...] = ()  # the parts of the fact that answer the question (default: every part)

    @property
    def answer(self) -> str:
        return fact(self.tool, self.city)

    def answered_by(self, text: str) -> bool:
        """Whether `text` carries a part of the fact that answers the question."""
        parts, text = fact_parts(self.tool, self.city), text.lower()
        return any(word in text for part in self.asks or tuple(parts)
                   for word in (SKY_WORDS[parts[part]] if part == "sky" else (parts[part],)))


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    """Train and held-out scenarios use disjoint cities, so held-out scores measure generalisation.
    The tools take turns (every step of three trains each), and each tool's (question, city) pairs
    are dealt from a shuffled deck: no scenario repeats until its tool's deck is spent."""
    cities = CITIES[:14] if split == "train" else CITIES[14:]  # held-out cities are never trained on
    rng = random.Random(f"{split}-{seed}")
    tools = sorted(QUESTIONS)
    decks: dict[str, list[tuple[str, str]]] = {tool: [] for tool in tools}
    out = []
    for i in range(count):
        tool = tools[i % len(tools)]
        if not decks[tool]:
            decks[tool] = [(question, city) for question in QUESTIONS[tool] for city in cities]
            rng.shuffle(decks[tool])
        question, city = decks[tool].pop()
        out.append(Scenario(f"{split}-{i}", question.format(city=city), tool, city, QUESTIONS[tool][question]))
    return out


def score(scenario: Scenario, tool_calls: list[tuple[str, dict]], final_answer: str) -> dict[str, float]:
    """Partial credit, one part at a time: the right tool (0.25), the right city (0.15), and an
    answer that says the part of the fact the question asks for in plain words (0.6). The fact
    echoed in the tool's markup (`<tool_response>4:30</tool_response>`, the base model's habit)
    earns no more than any other answer without it: when it earned part of the answer's credit,
    runs whose first groups held no plain answer learned to echo, surely, and never answered in
    words. Plain words without the fact earn nothing either, or the policy drops the fact along
    with the markup. `has_fact` (the fact anywhere, markup or not) is kept as a metric."""
    right_tool = any(name == scenario.tool for name, _ in tool_calls)
    right_city = any(args.get("city") == scenario.city for _, args in tool_calls)
    has_fact = scenario.answered_by(final_answer)
    plain = has_fact and "<" not in final_answer
    return {"right_tool": float(right_tool), "right_city": float(right_city), "has_fact": float(has_fact),
            "plain": float(plain), "reward": 0.25 * right_tool + 0.15 * right_city + 0.6 * plain}
