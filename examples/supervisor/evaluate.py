"""Score served models on the supervisor example's held-out scenarios and print a table.

    python -m examples.supervisor.evaluate                               # base vs trained, local backend
    python -m examples.supervisor.evaluate --trained shop-supervisor-s0  # a model trained by train.py
    python -m examples.supervisor.evaluate --base-url URL --models a b   # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. Both agents run greedily on the same model.
"""

from examples.evaluation import evaluate_main
from examples.supervisor.rollout import EXAMPLE

if __name__ == "__main__":
    evaluate_main(EXAMPLE, __doc__)
