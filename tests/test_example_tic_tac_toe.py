"""The tic-tac-toe example: the rules, the opponent, the scenarios, the reward on hand-made games
played through the real LangGraph game, one captured game as one training sequence, and the
train and evaluate commands on the tiny model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory
from langchain_core.language_models import GenericFakeChatModel
from langchain_core.messages import AIMessage

from examples.runner import Policy
from examples.tic_tac_toe.agent import play
from examples.tic_tac_toe.game import (
    EMPTY_BOARD,
    IllegalMoveError,
    empty_squares,
    is_over,
    opponent_move,
    place,
    render,
    winner,
)
from examples.tic_tac_toe.rollout import EXAMPLE, rollout
from examples.tic_tac_toe.task import score
from tests.conftest import ServerThread, run_example, training_server

# ----- rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("board", ["XXX.OO...", "O..XXXO..", "O.O...XXX", "X..XO.X.O", ".X.OX..X.", "X.O.XO..X",
                                   "O.X.X.XO."])
def test_every_line_of_three_wins(board: str) -> None:
    assert winner(board) == "X"
    assert is_over(board)


def test_no_winner_on_a_full_board_is_a_draw_and_a_game_in_progress_is_not_over() -> None:
    full = "XOXXOOOXX"
    assert winner(full) is None and is_over(full)
    assert winner("XX.OO....") is None and not is_over("XX.OO....")
    assert winner("OOOXX.X..") == "O"


def test_moves_go_on_empty_squares_only() -> None:
    board = place(EMPTY_BOARD, 5, "X")
    assert board == "....X...."
    assert place(board, 1, "O") == "O...X...."
    with pytest.raises(IllegalMoveError, match="square 5 is already taken by X"):
        place(board, 5, "O")
    with pytest.raises(IllegalMoveError, match="not on the board"):
        place(board, 10, "O")
    assert empty_squares("XO.X.O..X") == [3, 5, 7, 8]


def test_the_board_shows_marks_and_the_numbers_of_empty_squares() -> None:
    assert render("X...O...X") == " X | 2 | 3\n---+---+---\n 4 | O | 6\n---+---+---\n 7 | 8 | X"


# ----- opponent ------------------------------------------------------------------------------


def test_a_skilled_opponent_wins_when_it_can_and_blocks_otherwise() -> None:
    assert opponent_move("XX.OO.X..", seed=1, skill=1.0) == 6  # its own row first, not the block at 3
    assert opponent_move("XX..O....", seed=1, skill=1.0) == 3  # blocks X's top row
    assert opponent_move("X...O...X", seed=1, skill=1.0) in empty_squares("X...O...X")  # nothing to win or block


def test_the_random_opponent_is_legal_seeded_and_varied() -> None:
    board = "X...O...."
    moves = {seed: opponent_move(board, seed, skill=0.0) for seed in range(40)}
    assert set(moves.values()) <= set(empty_squares(board))
    assert len(set(moves.values())) >= 5  # seeds really change its play
    assert all(opponent_move(board, seed, skill=0.0) == move for seed, move in moves.items())  # same seed, same reply


def test_scenarios_are_reproducible_and_held_out_opponents_are_never_trained_on() -> None:
    train = EXAMPLE.scenarios("train", 200, 0)
    val = EXAMPLE.scenarios("val", 50, 0)
    assert EXAMPLE.scenarios("val", 50, 0) == val
    assert EXAMPLE.scenarios("train", 200, 1) != train
    assert not {s.opponent_seed for s in train} & {s.opponent_seed for s in val}
    assert {s.opponent_skill for s in train} == {0.0, 0.5} and {s.opponent_starts for s in train} == {False, True}
    for scenario in val:
        assert scenario.opening.count("O") == int(scenario.opponent_starts) and "X" not in scenario.opening


# ----- hand-made games through the real graph ----------------------------------------------


class ScriptedPlayer(GenericFakeChatModel):
    """Plays a fixed list of squares as `make_move` calls (binding tools changes nothing)."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedPlayer:
        return self


def scripted(squares: list[int]) -> ScriptedPlayer:
    calls: Iterator[AIMessage] = iter(
        AIMessage("", tool_calls=[{"name": "make_move", "args": {"square": s}, "id": f"call_{i}"}])
        for i, s in enumerate(squares))
    return ScriptedPlayer(messages=calls)


async def hand_made_game(agent: list[int], opponent: list[int], opening: str = EMPTY_BOARD) -> tuple[dict, dict]:
    replies = iter(opponent)
    game = await play(scripted(agent), lambda board: next(replies), opening)
    turns = sum(1 for m in game["messages"] if m.type == "ai")
    return game, score(game["outcome"], game["legal_moves"], turns)


async def test_a_won_game_scores_one() -> None:
    game, parts = await hand_made_game(agent=[1, 2, 3], opponent=[4, 5])
    assert (game["board"], game["outcome"]) == ("XXXOO....", "win")
    assert parts == {"win": 1.0, "draw": 0.0, "loss": 0.0, "illegal_move": 0.0, "legal_moves": 3.0, "turns": 3.0,
                     "reward": 1.0}
    # the agent saw each position: the opening, then the board after O's reply
    shown = [m.content for m in game["messages"] if m.type in ("human", "tool")]
    assert shown[0] == f"New game. You are X.\n\n{render(EMPTY_BOARD)}\n\nYour move."
    assert shown[1] == f"O played 4.\n\n{render('X..O.....')}\n\nYour move."
    assert shown[-1] == "Three in a row. You win!"


async def test_a_full_board_without_a_line_is_a_draw() -> None:
    game, parts = await hand_made_game(agent=[1, 3, 4, 6, 8], opponent=[2, 5, 7, 9])
    assert (game["board"], game["outcome"]) == ("XOXXOXOXO", "draw")
    assert parts["reward"] == 0.6 and parts["draw"] == 1.0 and parts["legal_moves"] == 5.0


async def test_a_lost_game_gets_credit_for_the_moves_it_lasted() -> None:
    game, parts = await hand_made_game(agent=[1, 2, 9], opponent=[5, 3, 7])
    assert (game["board"], game["outcome"]) == ("XXO.O.O.X", "loss")
    assert game["messages"][-1].content == "O played 7: three in a row. You lose."
    assert parts["reward"] == pytest.approx(0.1 + 3 * 0.04) and parts["loss"] == 1.0


async def test_an_illegal_move_ends_the_game_below_any_loss() -> None:
    game, parts = await hand_made_game(agent=[1, 5], opponent=[5])
    assert game["outcome"] == "illegal" and game["board"] == "X...O...."  # the illegal X was never placed
    assert game["messages"][-1].content == "Illegal move: square 5 is already taken by O. You lose."
    assert parts == {"win": 0.0, "draw": 0.0, "loss": 0.0, "illegal_move": 1.0, "legal_moves": 1.0, "turns": 2.0,
                     "reward": 0.04}
    _, latest_illegal = await hand_made_game(agent=[1, 2, 6, 7, 1], opponent=[3, 4, 8, 9])
    _, quickest_loss = await hand_made_game(agent=[1, 2, 9], opponent=[5, 3, 7])
    assert latest_illegal["legal_moves"] == 4.0
    assert latest_illegal["reward"] < quickest_loss["reward"] < 0.6


async def test_the_opponent_may_open() -> None:
    game, parts = await hand_made_game(agent=[1, 2, 3], opponent=[6, 7], opening="....O....")
    assert (game["board"], game["outcome"]) == ("XXX.OOO..", "win")
    assert parts["turns"] == 3.0


# ----- one real game on the tiny model: one conversation, one training sequence ------------


async def test_a_captured_game_is_one_token_exact_sequence(tiny_server: ServerThread) -> None:
    policy = Policy(f"{tiny_server.base_url}/v1", "tiny-random-smollm2", max_tokens=EXAMPLE.max_tokens)
    scenario = EXAMPLE.scenarios("val", 1, 0)[0]
    trajectory = await rollout(policy, scenario)
    turns = int(trajectory.metrics["turns"])
    assert turns >= 1 and trajectory.metrics["model_calls"] == turns
    assert "capture_errors" not in trajectory.metrics and not trajectory.additional_histories
    assert len(trajectory.choices()) == turns  # every move is a model turn of the one conversation
    stats = TokenizeStats()
    sequences = tokenize_trajectory(trajectory, 1.0, "game", stats, 8192)
    assert (len(sequences), stats.prefix_breaks) == (1, 0)
    outcome, board = trajectory.metadata["outcome"], trajectory.metadata["final_board"]
    assert trajectory.reward == score(outcome, int(trajectory.metrics["legal_moves"]), turns)["reward"]
    # the squares the model called are the X's on the final board (an illegal last move never lands)
    squares = [json.loads(c.message["tool_calls"][0]["function"]["arguments"])["square"] for c in trajectory.choices()]
    landed = squares[:-1] if outcome == "illegal" else squares
    assert sorted(landed) == [i + 1 for i, mark in enumerate(board) if mark == "X"]


# ----- the commands --------------------------------------------------------------------------


def test_train_runs_a_tiny_step_and_evaluate_prints_the_table(tmp_path: Path, tiny_engine: Any) -> None:
    args = ["--steps", "1", "--scenarios-per-step", "1", "--rollouts", "2", "--held-out", "2", "--art-dir", str(tmp_path)]
    with training_server(tiny_engine, tmp_path) as backend:  # the job against `art-backend serve`
        out = run_example("examples.tic_tac_toe.train", *args, "--backend-url", backend.base_url)
        table = run_example("examples.tic_tac_toe.evaluate", "--backend-url", backend.base_url, "--art-dir",
                            str(tmp_path), "--held-out", "2", "--models", "tiny-random-smollm2", "tic-tac-toe-agent-s0")
    assert "base model held-out score (step 0)" in out
    assert "win" in out and "illegal_move" in out and "held-out score: base" in out
    model_dir = tmp_path / "tic-tac-toe" / "models" / "tic-tac-toe-agent-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000
    assert (model_dir / "history.jsonl").is_file()
    header, *rows = table.strip().splitlines()[-3:]
    assert header.split()[:3] == ["model", "held-out", "score"] and "illegal_move" in header
    assert [row.split()[0] for row in rows] == ["tiny-random-smollm2", "tic-tac-toe-agent-s0"]
    assert all(len(row.split()) == 8 for row in rows)  # the score and the six metrics
