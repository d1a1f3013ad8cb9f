"""Scenarios (which opponent, who starts) and the reward for the tic-tac-toe agent.

A scenario fixes the scripted opponent: its seed (its random choices), its skill (how often it
wins or blocks when it can) and whether it moves first. Training and held-out scenarios draw
opponent seeds from disjoint ranges, so held-out games are against opponents never met in
training. The reward gives partial credit, so games of the small base model score differently
within a group (the signal GRPO learns from).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from examples.tic_tac_toe.game import EMPTY_BOARD, Outcome, opponent_move, place

SKILLS = (0.0, 0.5)  # a random opponent, and one that wins/blocks half of the time
SEED_RANGES = {"train": (0, 1_000_000), "val": (1_000_000, 2_000_000)}  # disjoint: held-out opponents are new

WIN, DRAW = 1.0, 0.6
LOSS = 0.1  # plus PER_LEGAL_MOVE for each legal move: a longer fight scores more than a quick loss
PER_LEGAL_MOVE = 0.04  # an illegal move ends the game with only this: 0.16 at most, below any loss


@dataclass(frozen=True)
class Scenario:
    id: str
    opponent_seed: int
    opponent_skill: float
    opponent_starts: bool

    @property
    def opening(self) -> str:
        """The board the agent first sees: empty, or with the opponent's first O."""
        if not self.opponent_starts:
            return EMPTY_BOARD
        return place(EMPTY_BOARD, opponent_move(EMPTY_BOARD, self.opponent_seed, self.opponent_skill), "O")


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    low, high = SEED_RANGES[split]
    rng = random.Random(f"{split}-{seed}")
    return [Scenario(f"{split}-{i}", rng.randrange(low, high), rng.choice(SKILLS), rng.random() < 0.5)
            for i in range(count)]


def score(outcome: Outcome, legal_moves: int, turns: int) -> dict[str, float]:
    """Win 1.0, draw 0.6, loss 0.1 + 0.04 per legal move, illegal move 0.04 per legal move made
    before it. Returned with the outcome's parts as metrics."""
    reward = {"win": WIN, "draw": DRAW, "loss": LOSS + PER_LEGAL_MOVE * legal_moves,
              "illegal": PER_LEGAL_MOVE * legal_moves}[outcome]
    return {"win": float(outcome == "win"), "draw": float(outcome == "draw"), "loss": float(outcome == "loss"),
            "illegal_move": float(outcome == "illegal"), "legal_moves": float(legal_moves), "turns": float(turns),
            "reward": round(reward, 6)}
