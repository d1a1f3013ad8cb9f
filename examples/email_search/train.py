"""Train the email-search LangGraph agent (ART-E style) on the embedded model.

    python -m examples.email_search.train             # the task's reward
    python -m examples.email_search.train --ruler     # RULER scores each group instead

The agent answers questions about a synthetic inbox (SQLite full-text search) with three
tools: search_inbox, read_email and return_final_answer. It scores the base model on held-out
questions (inboxes never seen in training), runs GRPO steps (rollouts grouped per question,
partial-credit rewards), scores the trained policy on the same questions and writes a
learning curve. With --ruler a judge (the base model, or --judge-base-url/--judge-model) ranks
each group and the task's reward stays as metrics/independent_reward. Interrupt it and run it
again: it resumes from the last checkpoint. `--model DIR` trains a bigger local model.
"""

from examples.email_search.rollout import EXAMPLE
from examples.runner import train_main

if __name__ == "__main__":
    train_main(EXAMPLE, __doc__)
