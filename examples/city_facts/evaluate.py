"""Score served models on the city-facts held-out scenarios and print a table.

    python -m examples.city_facts.evaluate                               # base vs trained, local backend
    python -m examples.city_facts.evaluate --trained city-agent-s0       # a model trained by train.py
    python -m examples.city_facts.evaluate --base-url URL --models a b   # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. The agent runs greedily, as in train.py's held-out score.
"""

from examples.city_facts.rollout import EXAMPLE
from examples.evaluation import evaluate_main

if __name__ == "__main__":
    evaluate_main(EXAMPLE, __doc__)
