"""Scenarios and the reward for the city-facts agent.

Each scenario asks one fact (weather, local time or population) about one city. The agent
must pick the matching tool with the city as argument, then answer in plain words with the
fact the tool returned (the base model mostly echoes the tool's markup instead). The reward
gives partial credit for each part, so rollouts of the small base model score differently
within a group (the signal GRPO learns from).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Dakar", "Perth",
          "Seoul", "Lagos", "Hanoi", "Accra", "Kyiv", "Riga", "Bern", "Doha", "Baku", "Sofia"]
QUESTIONS = {
    "get_weather": ["What is the weather like in {city}?", "Is it raining in {city} right now?",
                    "How warm is it in {city} today?"],
    "get_local_time": ["What time is it in {city}?", "Tell me the current local time in {city}.",
                       "Is it morning or evening in {city} now?"],
    "get_population": ["How many people live in {city}?", "What is the population of {city}?",
                       "How big is {city} by number of inhabitants?"],
}


def fact(tool: str, city: str) -> str:
    """The tool's answer: deterministic per city, so rewards can check the final reply."""
    seed = sum(map(ord, city))
    if tool == "get_weather":
        return f"{seed % 30 + 2} C, {['sunny', 'cloudy', 'rainy'][seed % 3]}"
    if tool == "get_local_time":
        return f"{seed % 12 + 1}:{seed % 6}0"
    return f"{seed % 9 + 1}.{seed % 10} million"


@dataclass(frozen=True)
class Scenario:
    id: str
    question: str
    tool: str
    city: str

    @property
    def answer(self) -> str:
        return fact(self.tool, self.city)


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    """Train and held-out scenarios use disjoint cities, so held-out scores measure generalisation."""
    cities = CITIES[:14] if split == "train" else CITIES[14:]  # held-out cities are never trained on
    rng = random.Random(f"{split}-{seed}")
    out = []
    for i in range(count):
        tool = rng.choice(sorted(QUESTIONS))
        city = rng.choice(cities)
        out.append(Scenario(f"{split}-{i}", rng.choice(QUESTIONS[tool]).format(city=city), tool, city))
    return out


def score(scenario: Scenario, tool_calls: list[tuple[str, dict]], final_answer: str) -> dict[str, float]:
    """Partial credit, one part at a time: the right tool (0.25), the right city (0.15), an answer
    that carries the fact's number (0.2), and says it in plain words rather than echoed tool
    markup (0.4). Plain words without the number earn nothing: a policy that drops the markup
    along with the fact must not look better than one that echoes the fact."""
    right_tool = any(name == scenario.tool for name, _ in tool_calls)
    right_city = any(args.get("city") == scenario.city for _, args in tool_calls)
    number = re.search(r"[\d.:]+", scenario.answer).group()
    has_number = number in final_answer
    plain = has_number and "<" not in final_answer
    return {"right_tool": float(right_tool), "right_city": float(right_city), "has_number": float(has_number),
            "plain": float(plain), "reward": 0.25 * right_tool + 0.15 * right_city + 0.2 * has_number + 0.4 * plain}
