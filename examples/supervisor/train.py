"""Train the shop assistant and its research sub-agent together, on the embedded model.

    python -m examples.supervisor.train

The supervisor delegates each customer question to a research sub-agent (a compiled LangGraph
subgraph with its own model node and catalogue tools). Every rollout's trajectory holds the
supervisor's conversation and, as an additional history, the sub-agent's: each step line shows
`sub_agent_histories` (captured per rollout) and how many training sequences the step trained,
one per conversation. It scores held-out products before and after, resumes when run again,
and writes a learning curve; `--model DIR` trains a bigger local model.
"""

from examples.runner import train_main
from examples.supervisor.rollout import EXAMPLE

if __name__ == "__main__":
    train_main(EXAMPLE, __doc__)
