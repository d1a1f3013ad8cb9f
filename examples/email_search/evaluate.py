"""Score served models on the email-search held-out questions and print a table.

    python -m examples.email_search.evaluate                               # base vs trained, local backend
    python -m examples.email_search.evaluate --trained email-agent-s1      # a model trained by train.py
    python -m examples.email_search.evaluate --base-url URL --models a b   # any OpenAI-compatible endpoint

Without --base-url it starts the local backend on --art-dir and serves the embedded base model
and the newest checkpoint of --trained. The agent runs greedily, as in train.py's held-out score.
"""

from examples.email_search.rollout import EXAMPLE
from examples.evaluation import evaluate_main

if __name__ == "__main__":
    evaluate_main(EXAMPLE, __doc__)
