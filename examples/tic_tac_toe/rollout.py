"""One rollout: play one game against the scenario's opponent inside `art_capture()` and score it."""

from __future__ import annotations

from functools import partial

from art_integrations import Trajectory, art_capture
from examples.runner import Example, Policy
from examples.tic_tac_toe.agent import play
from examples.tic_tac_toe.game import opponent_move
from examples.tic_tac_toe.task import Scenario, scenarios, score


async def rollout(policy: Policy, scenario: Scenario) -> Trajectory:
    opponent = partial(opponent_move, seed=scenario.opponent_seed, skill=scenario.opponent_skill)
    async with art_capture(scenario=scenario.id) as trajectory:
        game = await play(policy.langchain(), opponent, scenario.opening)
    turns = sum(1 for m in game["messages"] if m.type == "ai")
    parts = score(game["outcome"], game["legal_moves"], turns)
    trajectory.reward = parts.pop("reward")
    trajectory.metrics.update(parts)
    trajectory.metadata.update(outcome=game["outcome"], final_board=game["board"])
    return trajectory


EXAMPLE = Example(
    project="tic-tac-toe",
    model_prefix="tic-tac-toe-agent",
    title="tic-tac-toe agent",
    scenarios=scenarios,
    rollout=rollout,
    metrics=("win", "draw", "loss", "illegal_move", "legal_moves", "turns"),
    max_tokens=40,  # a make_move call is 29 tokens
)
