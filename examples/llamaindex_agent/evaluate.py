"""Score served models on the LlamaIndex unit-conversion held-out questions and print a table.

    python -m examples.llamaindex_agent.evaluate                              # base vs trained, local backend
    python -m examples.llamaindex_agent.evaluate --trained units-agent-s0     # a model trained by train.py
    python -m examples.llamaindex_agent.evaluate --base-url URL --models a b  # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. The agent runs greedily, as in train.py's held-out score.
"""

from examples.evaluation import evaluate_main
from examples.llamaindex_agent.rollout import EXAMPLE

if __name__ == "__main__":
    evaluate_main(EXAMPLE, __doc__)
