"""Score served models on the tic-tac-toe held-out games and print a table.

    python -m examples.tic_tac_toe.evaluate                                  # base vs trained, local backend
    python -m examples.tic_tac_toe.evaluate --trained tic-tac-toe-agent-s0   # a model trained by train.py
    python -m examples.tic_tac_toe.evaluate --base-url URL --models a b      # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. The agent plays greedily, as in train.py's held-out
score, so each model plays the same held-out games every time. An endpoint must support a named
`tool_choice`, since every turn is a forced `make_move` call.
"""

from examples.evaluation import evaluate_main
from examples.tic_tac_toe.rollout import EXAMPLE

if __name__ == "__main__":
    evaluate_main(EXAMPLE, __doc__)
