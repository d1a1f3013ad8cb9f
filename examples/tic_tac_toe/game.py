"""Tic-tac-toe rules and the scripted opponent: plain Python, no model involved.

A board is a string of 9 cells, row by row: "X" (the agent), "O" (the opponent) or "."
(empty). Squares are numbered 1-9 the way players read them, left to right, top to bottom:

     1 | 2 | 3
    ---+---+---
     4 | 5 | 6
    ---+---+---
     7 | 8 | 9
"""

from __future__ import annotations

import random
from typing import Literal

Outcome = Literal["win", "draw", "loss", "illegal"]  # "illegal": the agent's move broke the rules, which ends the game

EMPTY_BOARD = "." * 9
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))


class IllegalMoveError(ValueError):
    pass


def empty_squares(board: str) -> list[int]:
    return [i + 1 for i, cell in enumerate(board) if cell == "."]


def place(board: str, square: int, mark: str) -> str:
    """The board after `mark` goes on `square` (1-9); IllegalMoveError if it is off the board or taken."""
    if not 1 <= square <= 9:
        raise IllegalMoveError(f"square {square} is not on the board (1-9)")
    if board[square - 1] != ".":
        raise IllegalMoveError(f"square {square} is already taken by {board[square - 1]}")
    return board[:square - 1] + mark + board[square:]


def winner(board: str) -> str | None:
    """"X" or "O" when that mark has three in a row, else None."""
    for a, b, c in LINES:
        if board[a] != "." and board[a] == board[b] == board[c]:
            return board[a]
    return None


def is_over(board: str) -> bool:
    return winner(board) is not None or "." not in board


def render(board: str) -> str:
    """The board as the agent sees it: marks where played, the square's number where empty.

    No separate list of empty squares: with one, the base model already plays legally when
    greedy (it copies the first number), so the held-out score had nothing to show; without
    it, playing legally means reading the board, which GRPO teaches (see the figures in docs/examples.md)."""
    cells = [mark if mark != "." else str(i + 1) for i, mark in enumerate(board)]
    rows = [" " + " | ".join(cells[r:r + 3]) for r in (0, 3, 6)]
    return "\n---+---+---\n".join(rows)


def completing_square(board: str, mark: str) -> int | None:
    """A square that would give `mark` three in a row, if there is one (the lowest)."""
    for square in empty_squares(board):
        if winner(place(board, square, mark)) == mark:
            return square
    return None


def opponent_move(board: str, seed: int, skill: float) -> int:
    """The scripted opponent's square (it plays "O"). With probability `skill` it plays like a
    careful beginner: win if it can, else block the agent's three in a row; otherwise it picks
    an empty square at random. The choice is a pure function of (seed, board), so every rollout
    of a GRPO group meets the same opponent: the same position always gets the same reply."""
    rng = random.Random(f"{seed}:{board}")
    if rng.random() < skill:
        tactical = completing_square(board, "O") or completing_square(board, "X")
        if tactical is not None:
            return tactical
    return rng.choice(empty_squares(board))
