"""Trajectories to training sequences, from the exact token ids captured at rollout time.

Each history (the main conversation and every additional one) is walked turn by turn. A turn
whose prompt ids extend the running sequence exactly (the previous prompt + completion) is
appended: the new prompt suffix with mask 0, the completion with mask 1 and its rollout
logprobs. A turn that does not extend it (the agent rewrote its history, or the chat template
re-tokenized an earlier turn differently) starts a new sequence; such prefix breaks are counted.
Every sequence of a trajectory carries that trajectory's advantage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from art_integrations.trajectory import Choice, History, Trajectory


class MissingTokensError(ValueError):
    pass


@dataclass
class TrainSequence:
    token_ids: list[int]
    assistant_mask: list[bool]  # True where the policy produced the token (trained on)
    logprobs: list[float]  # rollout logprob per token; NaN where unknown or not trained
    advantage: float
    weight: float  # per-token weight: 1 / (assistant tokens of its trajectory)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class TokenizeStats:
    sequences: int = 0
    prefix_breaks: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    notes: list[str] = field(default_factory=list)


def _turn_tokens(choice: Choice, where: str) -> tuple[list[int], list[int], list[float]]:
    if choice.prompt_token_ids is None or choice.token_ids is None:
        raise MissingTokensError(
            f"{where} has no token ids, so it cannot be trained on exactly. Capture model calls "
            "with art_capture() (the drop-in chat model or callback handler), or call the backend "
            "with extra_body={'return_token_ids': True} and logprobs=True and build the turn with "
            "Choice.from_openai(response)."
        )
    logprobs = choice.token_logprobs
    if logprobs is None or len(logprobs) != len(choice.token_ids):
        # On-policy rollouts without logprobs: the trainer uses the current policy's (ratio 1).
        logprobs = [math.nan] * len(choice.token_ids)
    return choice.prompt_token_ids, choice.token_ids, logprobs


def _history_sequences(history: History, where: str, stats: TokenizeStats) -> list[tuple[list[int], list[bool], list[float]]]:
    sequences: list[tuple[list[int], list[bool], list[float]]] = []
    ids: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    for turn, choice in enumerate(history.choices()):
        prompt, completion, completion_logprobs = _turn_tokens(choice, f"{where}, model turn {turn}")
        if ids and prompt[: len(ids)] != ids:
            stats.prefix_breaks += 1
            sequences.append((ids, mask, logprobs))
            ids, mask, logprobs = [], [], []
        new_prompt = prompt[len(ids):]
        ids = ids + new_prompt + completion
        mask = mask + [False] * len(new_prompt) + [True] * len(completion)
        logprobs = logprobs + [math.nan] * len(new_prompt) + completion_logprobs
    if ids:
        sequences.append((ids, mask, logprobs))
    return [s for s in sequences if any(s[1])]  # an empty completion leaves nothing to train


def tokenize_trajectory(trajectory: Trajectory, advantage: float, where: str, stats: TokenizeStats,
                        max_length: int) -> list[TrainSequence]:
    raw = []
    for h, history in enumerate(trajectory.histories()):
        label = where if h == 0 else f"{where}, additional history {h - 1}"
        raw += _history_sequences(history, label, stats)
    assistant_tokens = sum(sum(mask) for _, mask, _ in raw)
    if assistant_tokens == 0:
        return []
    out = []
    for ids, mask, logprobs in raw:
        if len(ids) > max_length:
            stats.truncated += 1
            ids, mask, logprobs = ids[:max_length], mask[:max_length], logprobs[:max_length]
        out.append(TrainSequence(ids, mask, logprobs, advantage, 1.0 / assistant_tokens))
    stats.sequences += len(out)
    stats.assistant_tokens += sum(sum(s.assistant_mask) for s in out)
    return out
