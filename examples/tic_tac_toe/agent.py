"""The game, written as a LangGraph user writes one: a player node (the chat model) and an
environment node (the rules and the opponent), looping until the game is over.

The only ART-specific line is the chat model the rollout passes in (`policy.langchain()`, a
`ChatART`). Every turn must be a move, so the player is bound to the `make_move` tool with
`tool_choice="make_move"`: the backend then decodes only well-formed calls, and the 135M model
never answers in prose. The environment answers each move with a tool message: the opponent's
reply and the new board. All turns stay in one growing message list, so each model call's
prompt extends the previous call's prompt and reply token for token: one training sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain_core.messages import AIMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from pydantic import BaseModel, Field

from examples.tic_tac_toe.game import IllegalMoveError, Outcome, is_over, place, render, winner

SYSTEM_PROMPT = ("You play tic-tac-toe as X against O. Three X in a row (across, down or diagonal) wins. "
                 "The board shows each empty square's number. On your turn call make_move with the number "
                 "of an empty square.")


class make_move(BaseModel):  # noqa: N801 - a tool's name is its class name, as in LangChain's tool-calling docs
    """Put your X on an empty square."""

    square: int = Field(ge=1, le=9, description="the number of an empty square, 1-9")


class Game(MessagesState):
    board: str  # 9 cells, "X", "O" or "."; see game.py
    legal_moves: int  # the agent's legal moves so far
    outcome: Outcome | None  # set when the game is over


def first_message(board: str) -> str:
    return f"New game. You are X.\n\n{render(board)}\n\nYour move."


def build_game(llm: Any, opponent: Callable[[str], int]) -> Any:
    """`opponent(board)` is the square O plays on `board`."""
    player = llm.bind_tools([make_move], tool_choice="make_move")

    async def agent(state: Game) -> dict[str, Any]:
        reply = await player.ainvoke([SystemMessage(SYSTEM_PROMPT), *state["messages"]])
        return {"messages": [reply]}

    def environment(state: Game) -> dict[str, Any]:
        reply: AIMessage = state["messages"][-1]
        if not reply.tool_calls:  # only if the reply ran out of tokens mid-call: counts as no move
            return {"outcome": "illegal"}
        call = reply.tool_calls[0]

        def answer(text: str, **update: Any) -> dict[str, Any]:
            return {"messages": [ToolMessage(text, tool_call_id=call["id"])], **update}

        try:
            board = place(state["board"], int(call["args"]["square"]), "X")
        except (IllegalMoveError, KeyError, TypeError, ValueError) as error:
            # The game ends here: the illegal move is the trajectory's last turn, so its low
            # reward lands on the move that caused it (a retry would blur that).
            return answer(f"Illegal move: {error}. You lose.", outcome="illegal")
        legal_moves = state["legal_moves"] + 1
        if winner(board) == "X":
            return answer("Three in a row. You win!", board=board, legal_moves=legal_moves, outcome="win")
        if is_over(board):
            return answer("The board is full. It is a draw.", board=board, legal_moves=legal_moves, outcome="draw")
        square = opponent(board)
        board = place(board, square, "O")
        if winner(board) == "O":
            return answer(f"O played {square}: three in a row. You lose.", board=board, legal_moves=legal_moves,
                          outcome="loss")
        if is_over(board):
            return answer(f"O played {square}. The board is full. It is a draw.", board=board,
                          legal_moves=legal_moves, outcome="draw")
        return answer(f"O played {square}.\n\n{render(board)}\n\nYour move.", board=board, legal_moves=legal_moves)

    graph = StateGraph(Game)
    graph.add_node("agent", agent)
    graph.add_node("environment", environment)
    graph.add_edge(START, "agent")
    graph.add_edge("agent", "environment")
    graph.add_conditional_edges("environment", lambda state: END if state.get("outcome") else "agent")
    return graph.compile()


async def play(llm: Any, opponent: Callable[[str], int], opening: str) -> dict[str, Any]:
    """One game from `opening`; the final state (messages, board, legal_moves, outcome)."""
    game = build_game(llm, opponent)
    return await game.ainvoke({"messages": [("user", first_message(opening))], "board": opening,
                               "legal_moves": 0, "outcome": None})
