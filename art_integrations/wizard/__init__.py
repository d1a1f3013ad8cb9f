"""`art-integrations init`: asks what a new RL training project needs, one question at a time,
and writes a runnable training script (see `questions.py` for the questions, `script.py` for
what is written)."""

from art_integrations.wizard.cli import main

__all__ = ["main"]
