"""Train the LlamaIndex unit-conversion agent on the embedded model and show it improve.

    python -m examples.llamaindex_agent.train

A `FunctionAgent` with three conversion tools, its LLM `ARTLLM` on the local backend; each
rollout runs inside `art_capture()` and gets a partial-credit reward. It scores held-out
questions (values never trained on) before and after the GRPO steps, resumes from the last
checkpoint when run again, and writes a learning curve. `--model DIR` trains a bigger local model.
"""

from examples.llamaindex_agent.rollout import EXAMPLE
from examples.runner import train_main

if __name__ == "__main__":
    train_main(EXAMPLE, __doc__)
