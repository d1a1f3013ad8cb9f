"""The token view: the exact sequences a trajectory trains on, each token decoded on its own,
with the trained ones (the assistant mask) marked.

The sequences come from `art_backend.training.tokenize`, the code the trainer uses, so the view
shows what training saw: the prompt of each turn, chained turns, and a new sequence wherever a
turn's prompt did not extend the previous one (a prefix break). Decoding needs the tokenizer of
the model's base model, which is found from the name stored in `model.json` (the embedded and
the tiny test model are known) or given with `art-backend view --model DIR`.
"""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from art_backend.model_store import (
    EMBEDDED_MODEL_NAME,
    TINY_MODEL_NAME,
    ModelNotFoundError,
    resolve_model_dir,
)
from art_backend.training.tokenize import MissingTokensError, TokenizeStats, tokenize_trajectory
from art_integrations.trajectory import Trajectory


@dataclass(frozen=True)
class TokenCell:
    token_id: int
    text: str  # the token decoded alone; newlines shown as a visible mark plus the line break
    trained: bool
    logprob: float | None  # the rollout logprob of a trained token, when captured


@dataclass(frozen=True)
class TokenSequence:
    label: str
    cells: list[TokenCell]

    @property
    def trained_count(self) -> int:
        return sum(cell.trained for cell in self.cells)


@dataclass(frozen=True)
class TokenView:
    sequences: list[TokenSequence]
    prefix_breaks: int
    problem: str | None = None  # why there is nothing to show (no token ids, no tokenizer)


class Tokenizers:
    """The tokenizer to decode a stored model's tokens with, loaded once per directory.

    `model`: what `art-backend serve --model` took (a directory or the tiny model's name); None
    finds the directory from the stored base model's name."""

    def __init__(self, cache_dir: Path, model: str | None = None) -> None:
        self.cache_dir = cache_dir
        self.model = model
        self._loaded: dict[Path, Any] = {}
        self._lock = threading.Lock()  # pages are served from a thread pool; load each tokenizer once

    def directory_for(self, base_model: str | None) -> Path:
        if self.model is not None:
            return resolve_model_dir(self.model, self.cache_dir)
        if base_model == EMBEDDED_MODEL_NAME:
            return resolve_model_dir(None, self.cache_dir)
        if base_model == TINY_MODEL_NAME:
            return resolve_model_dir(TINY_MODEL_NAME, self.cache_dir)
        raise ModelNotFoundError(
            f"The base model {base_model!r} is not one the viewer knows by name, so its tokenizer is unknown: "
            "start the viewer with `art-backend view --model DIR`, DIR being the model directory the backend "
            "served (`art-backend serve --model DIR`).")

    def tokenizer_for(self, base_model: str | None) -> tuple[Any, Path]:
        directory = self.directory_for(base_model)
        with self._lock:
            if directory not in self._loaded:
                from transformers import AutoTokenizer  # heavy import, only when a token view is asked for

                self._loaded[directory] = AutoTokenizer.from_pretrained(directory)
            return self._loaded[directory], directory


def _shown(text: str) -> str:
    return text.replace("\n", "\u21b5\n").replace("\t", "\u2192\t")


def token_view(trajectory: Trajectory, tokenizer: Any) -> TokenView:
    """The training sequences of every history of `trajectory` (the main one first), decoded.
    Each history is tokenized on its own so a sequence can be labelled with the history it
    came from; the chaining inside a history is exactly the trainer's."""
    sequences: list[TokenSequence] = []
    stats = TokenizeStats()
    for index, history in enumerate(trajectory.histories()):
        label = "main conversation" if index == 0 else f"additional history {index}"
        alone = Trajectory(messages_and_choices=history.messages_and_choices, tools=history.tools)
        try:
            # The stored data does not say which max_sequence_length the step used, so nothing is
            # cut here; training cut sequences longer than that.
            history_sequences = tokenize_trajectory(alone, 0.0, label, stats, sys.maxsize)
        except MissingTokensError as error:
            return TokenView([], stats.prefix_breaks, str(error))
        for number, sequence in enumerate(history_sequences, 1):
            if max(sequence.token_ids, default=0) >= len(tokenizer):
                return TokenView([], stats.prefix_breaks, (
                    f"Token id {max(sequence.token_ids)} is outside this tokenizer's vocabulary ({len(tokenizer)} "
                    "tokens): the tokenizer is not the base model's; pass the right one with --model."))
            texts = tokenizer.batch_decode([[token_id] for token_id in sequence.token_ids],
                                           skip_special_tokens=False, clean_up_tokenization_spaces=False)
            cells = [TokenCell(token_id, _shown(text), in_mask,
                               logprob if in_mask and not math.isnan(logprob) else None)
                     for token_id, text, in_mask, logprob in zip(sequence.token_ids, texts, sequence.assistant_mask,
                                                                 sequence.logprobs, strict=True)]
            name = label if len(history_sequences) == 1 else f"{label}, sequence {number}"
            sequences.append(TokenSequence(name, cells))
    return TokenView(sequences, stats.prefix_breaks)
