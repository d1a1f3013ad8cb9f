"""Train the tic-tac-toe LangGraph agent with GRPO on the embedded model.

    python -m examples.tic_tac_toe.train

It scores the base model on held-out games (opponent seeds never met in training), runs GRPO
steps (rollouts grouped per opponent, partial-credit rewards for wins, draws, losses and legal
moves), scores the trained policy on the same held-out games, and writes a learning curve.
Interrupt it and run it again: it resumes from the last checkpoint. `--model DIR` trains a
bigger local model instead.
"""

from examples.runner import train_main
from examples.tic_tac_toe.rollout import EXAMPLE

if __name__ == "__main__":
    train_main(EXAMPLE, __doc__)
