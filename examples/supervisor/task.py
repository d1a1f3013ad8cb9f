"""Scenarios and the reward for the shopping assistant with a research sub-agent.

Each scenario is a customer's question about one product of the shop's catalogue: its price,
how many are in stock, or how soon it ships. The assistant (the supervisor) must hand the
lookup to its research sub-agent, naming the product and the topic; the sub-agent looks the
fact up with the matching catalogue tool, whose answer goes back; the assistant answers the
customer with the number. Both agents' turns are trained, so the reward credits each one's part.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

PRODUCTS = ("blue kettle", "red lamp", "green mug", "black desk", "white chair", "grey sofa", "yellow rug",
            "brown shelf", "pink vase", "silver clock", "orange towel", "purple pillow", "gold mirror",
            "navy curtain", "beige stool", "teal bowl", "olive basket", "cream blanket", "tan bench", "ivory candle")
TOPICS = {"price": "get_price", "stock": "get_stock", "delivery": "get_delivery_days"}  # the tool for each
QUESTIONS = {
    "get_price": ["How much does the {product} cost?", "What is the price of the {product}?",
                  "I'd like to buy the {product}. How much is it?"],
    "get_stock": ["How many of the {product} do you have in stock?", "Is the {product} in stock? How many are left?",
                  "How many units of the {product} are available?"],
    "get_delivery_days": ["How long does delivery of the {product} take?", "When would the {product} arrive if I "
                          "order it today?", "How many days does shipping the {product} take?"],
}


def fact(tool: str, product: str) -> str:
    """The catalogue's answer: deterministic per product, so rewards can check the final reply."""
    seed = sum(map(ord, product))
    if tool == "get_price":
        return f"{seed % 90 + 10}.{seed % 10}0 EUR"
    if tool == "get_stock":
        return f"{seed % 80 + 12} units in stock"
    return f"ships in {seed % 6 + 2} days"


@dataclass(frozen=True)
class Scenario:
    id: str
    question: str
    tool: str
    product: str

    @property
    def topic(self) -> str:
        return next(topic for topic, tool in TOPICS.items() if tool == self.tool)

    @property
    def answer(self) -> str:
        return fact(self.tool, self.product)

    @property
    def number(self) -> str:
        """The number the customer's answer must carry."""
        return re.search(r"\d+(?:\.\d+)?", self.answer).group()


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    """Train and held-out scenarios ask about disjoint products: held-out scores measure generalisation."""
    products = PRODUCTS[:14] if split == "train" else PRODUCTS[14:]
    rng = random.Random(f"{split}-{seed}")
    out = []
    for i in range(count):
        tool = rng.choice(sorted(QUESTIONS))
        product = rng.choice(products)
        out.append(Scenario(f"{split}-{i}", rng.choice(QUESTIONS[tool]).format(product=product), tool, product))
    return out


def score(scenario: Scenario, requests: list[dict], research_calls: list[tuple[str, dict]],
          final_answer: str) -> dict[str, float]:
    """Partial credit for each agent's part: the supervisor's request names the product and the
    topic (0.1 each); the sub-agent calls the right catalogue tool, for the right product (0.1
    each); the answer to the customer carries the fact's number (0.3), and says it in plain words
    rather than echoed markup (0.3; words without the number earn nothing)."""
    right_request = max((0.5 * (r.get("product") == scenario.product) + 0.5 * (r.get("topic") == scenario.topic)
                         for r in requests), default=0.0)
    right_lookup = max((0.5 * (name == scenario.tool) + 0.5 * (args.get("product") == scenario.product)
                        for name, args in research_calls), default=0.0)
    has_number = scenario.number in final_answer
    plain = has_number and "<" not in final_answer
    return {"right_request": right_request, "right_lookup": right_lookup, "has_number": float(has_number),
            "plain": float(plain), "reward": 0.2 * right_request + 0.2 * right_lookup + 0.3 * has_number + 0.3 * plain}
