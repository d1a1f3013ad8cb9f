"""The main job: train the city-facts LangGraph agent on the embedded model and show it improve.

    python -m examples.city_facts.train            # or: make run

It scores the base model on held-out scenarios (cities never seen in training), runs GRPO
steps (rollouts grouped per scenario, partial-credit rewards), scores the trained policy on
the same held-out scenarios, and writes a learning curve. Interrupt it and run it again: it
resumes from the last checkpoint. `--model DIR` trains a bigger local model instead.
"""

from examples.city_facts.rollout import EXAMPLE
from examples.runner import train_main

if __name__ == "__main__":
    train_main(EXAMPLE, __doc__)
