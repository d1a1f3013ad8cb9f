"""Supervised fine-tuning (SFT): demonstrations to training sequences, and their loss.

A demonstration is a Trajectory. Each of its conversations (the main one and every additional
history) becomes sequences in one of two ways:

- captured (every model turn is a Choice with its token ids): the exact tokens, joined turn to
  turn as a GRPO step joins them (tokenize.py);
- rendered (a teacher's messages, a file's lines: no token ids): assistant message i is the reply
  to messages[:i]. Its prompt is what serving renders for messages[:i] (`ChatFormatter`, with the
  tools) and tokenizes (`TokenContinuations`: an earlier turn keeps its ids); its completion is the
  text the model's own template writes for that message (content, then tool calls in the family's
  markup), tokenized, then the end-of-turn token serving stops on. So a rendered conversation is
  token for token what serving would have prompted and produced for it.

Turns whose prompt extends the running sequence are appended to it (prompt suffix untrained,
completion trained); one that does not starts a new sequence (a prefix break, counted). Which
completions are trained: every assistant turn (`assistant_turns="all"`) or the last one
("last"); a message with OpenAI's `"weight": 0` is context only.

The loss, over the trained tokens T of one batch (x_t: the demonstrated token at t):

    loss = (1 / |T|) * sum_{t in T} -log p_theta(x_t | x_<t)

a token mean: every demonstrated token counts the same (as ART's and TRL's SFT). The trainer
passes per-token weights w_t = 1 / |T|, so each micro-batch's loss is its share of the batch's and
the gradients accumulate; sequences are packed as prefix trees as in a GRPO step (packing.py),
so a system prompt shared by many demonstrations is computed once. A step is one checkpoint:
the trajectories are cut into batches of `batch_size`, one optimizer step each, batch b at
learning rate lr_b.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from art_backend.chat_format import ChatFormatError, ChatFormatter, encode_prompt
from art_backend.continuation import TokenContinuations
from art_backend.engine.base import Engine, end_of_turn_ids
from art_backend.training.loss import LossConfig, LossTerms
from art_backend.training.tokenize import TrainSequence
from art_integrations.training import TrainSFTConfig
from art_integrations.trajectory import Choice, History, Trajectory

# ART's LocalBackend trains SFT in batches of two trajectories when asked for "auto"
AUTO_BATCH_SIZE = 2
SFT_LOSS = LossConfig("sft")
_STAND_IN = "ARTSFTREPLY7Q3"  # plain text no template rewrites, to find where a reply is written


class SFTRequestError(ValueError):
    """A demonstration that cannot be trained on (the message names it and the fix)."""


def sft_loss(logp: Tensor, weights: Tensor) -> LossTerms:
    """Cross-entropy of the demonstrated tokens: `logp` their log-probabilities under the model,
    `weights` 1/|T| on trained tokens (0 elsewhere), summing to 1 over the batch."""
    loss = -(logp * weights).sum()
    zero = torch.zeros((), device=logp.device)
    return LossTerms(loss, loss.detach(), zero, zero)


@dataclass
class Turn:
    prompt: list[int]
    completion: list[int]
    trained: bool


@dataclass
class SFTStats:
    sequences: int = 0
    prefix_breaks: int = 0
    trained_tokens: int = 0
    truncated: int = 0
    exact_histories: int = 0
    rendered_histories: int = 0


@dataclass
class Renderer:
    """Serving's formatter and tokenizer, and the tokens the engine ends a reply on."""

    formatter: ChatFormatter
    tokenizer: Any
    stop_ids: list[int]
    _stop_texts: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._stop_texts = {self.tokenizer.decode([i], skip_special_tokens=False): i for i in self.stop_ids}

    @classmethod
    def of(cls, engine: Engine, formatter: ChatFormatter) -> Renderer:
        """The renderer of what `engine` serves through `formatter`, ending replies where it stops."""
        stop_ids = getattr(engine, "stop_ids", None) or end_of_turn_ids(engine.tokenizer, None)
        return cls(formatter, engine.tokenizer, sorted(stop_ids))

    def turns(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, where: str) -> list[Turn]:
        """Each assistant message of `messages` as the prompt serving would render before it and
        the completion that would have produced it."""
        continuations = TokenContinuations(self.tokenizer)  # this conversation's turns only
        turns: list[Turn] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if i == 0:
                raise SFTRequestError(f"{where}: messages[0] is an assistant message, which answers nothing: start "
                                      "with a system or user message")
            try:
                prompt = self.formatter.render_prompt(messages[:i], tools)
                written = self._reply_onwards(messages[:i + 1], tools, prompt.text, f"{where}, messages[{i}]")
            except ChatFormatError as error:
                raise SFTRequestError(f"{where}, messages[{i}]: {error}") from error
            completion_text, stop_id = self._reply(written, f"{where}, messages[{i}]")
            calls_before = {c["id"] for m in messages[:i] for c in m.get("tool_calls") or () if c.get("id")}
            prompt_ids = continuations.tokenize(prompt.text, calls_before)
            completion = encode_prompt(self.tokenizer, completion_text) + [stop_id]
            continuations.remember(prompt_ids, completion, [c["id"] for c in message.get("tool_calls") or ()
                                                            if c.get("id")])
            turns.append(Turn(prompt_ids, completion, message.get("weight", 1) != 0))
        return turns

    def _reply_onwards(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, prompt: str,
                       where: str) -> str:
        """The template's text from where the last message (the reply) starts. Mostly the prompt
        is the start of the conversation written with the reply (the reply then opens with what
        the model writes first, e.g. Qwen3's empty think block); a template that writes earlier
        turns otherwise once a reply follows (Mistral's moves the system prompt to the last user
        turn) puts the reply where a stand-in reply's text lands."""
        written = self.formatter.render(messages, tools)
        if written.startswith(prompt):
            return written[len(prompt):]
        stand_in = self.formatter.render([*messages[:-1], {"role": "assistant", "content": _STAND_IN}], tools)
        at = stand_in.find(_STAND_IN)
        if at < 0 or written[:at] != stand_in[:at]:
            raise SFTRequestError(f"{where}: the chat template writes this assistant message so that its start "
                                  "cannot be found, so its reply cannot be told apart from its prompt")
        return written[at:]

    def _reply(self, rest: str, where: str) -> tuple[str, int]:
        """The reply's text (what precedes the first end-of-turn token) and that token."""
        found = [(rest.find(text), i) for text, i in self._stop_texts.items() if text and text in rest]
        if not found:
            raise SFTRequestError(f"{where}: the chat template ends this assistant message with none of the tokens "
                                  f"serving stops on ({', '.join(map(repr, self._stop_texts))}), so no reply the "
                                  "model could produce ends as it does")
        at, stop_id = min(found)
        return rest[:at], stop_id


def _exact_turns(choices: list[Choice]) -> list[Turn]:
    return [Turn(list(c.prompt_token_ids or ()), list(c.token_ids or ()), True) for c in choices]


def _joined(turns: list[Turn], stats: SFTStats) -> list[tuple[list[int], list[bool]]]:
    """Turns as sequences: a turn whose prompt extends the running ids continues it, any other
    starts a new one (see tokenize.py)."""
    sequences: list[tuple[list[int], list[bool]]] = []
    ids: list[int] = []
    mask: list[bool] = []
    for turn in turns:
        if ids and turn.prompt[:len(ids)] != ids:
            stats.prefix_breaks += 1
            sequences.append((ids, mask))
            ids, mask = [], []
        new_prompt = turn.prompt[len(ids):]
        ids = ids + new_prompt + turn.completion
        mask = mask + [False] * len(new_prompt) + [turn.trained] * len(turn.completion)
    if ids:
        sequences.append((ids, mask))
    return [s for s in sequences if any(s[1])]


def history_sequences(history: History, where: str, renderer: Renderer, assistant_turns: str,
                      stats: SFTStats) -> list[tuple[list[int], list[bool]]]:
    choices = history.choices()
    captured = bool(choices) and all(c.prompt_token_ids is not None and c.token_ids is not None for c in choices)
    if captured:
        turns = _exact_turns(choices)
        stats.exact_histories += 1
    else:  # a choice without ids means the tokens are not all known: the whole conversation is rendered
        turns = renderer.turns(history.messages(), history.tools, where)
        stats.rendered_histories += 1
    if assistant_turns == "last" and turns:
        turns = [Turn(t.prompt, t.completion, False) for t in turns[:-1]] + [turns[-1]]
    return _joined(turns, stats)


def trajectory_sequences(trajectory: Trajectory, where: str, renderer: Renderer, assistant_turns: str,
                         max_length: int, vocabulary: int, stats: SFTStats) -> list[TrainSequence]:
    raw: list[tuple[list[int], list[bool]]] = []
    for h, history in enumerate(trajectory.histories()):
        label = where if h == 0 else f"{where}, additional history {h - 1}"
        raw += history_sequences(history, label, renderer, assistant_turns, stats)
    if not raw:
        raise SFTRequestError(f"{where} has no assistant turn to learn from: a demonstration needs at least one "
                              "assistant message (or captured model turn) that is trained (not `\"weight\": 0`)")
    foreign = sorted({t for ids, _ in raw for t in ids if not 0 <= t < vocabulary})
    if foreign:
        raise SFTRequestError(f"{where}: token ids {foreign[:5]} are outside this model's vocabulary "
                              f"(0..{vocabulary - 1}): they were captured from another model. Leave the turns' "
                              "token ids out (messages only) to have them rendered for this one.")
    out = []
    for ids, mask in raw:
        if len(ids) > max_length:  # the head is kept, as a GRPO step keeps it
            stats.truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        mask = [False, *mask[1:]]  # a sequence's first token follows nothing: no logits predict it
        if any(mask):
            # advantage and logprobs are the policy loss's: unused by `sft_loss`
            out.append(TrainSequence(ids, mask, [math.nan] * len(ids), 1.0, 1.0))
    if not out:
        raise SFTRequestError(f"{where}: every assistant turn starts after token {max_length}, the longest sequence "
                              "trained here, so nothing of it would be learnt: shorten the conversation before its "
                              "answers (or train the answer with less context)")
    stats.sequences += len(out)
    stats.trained_tokens += sum(sum(s.assistant_mask) for s in out)
    return out


@dataclass
class SFTPlan:
    batches: list[list[TrainSequence]]  # one optimizer step each
    learning_rates: list[float]
    metrics: dict[str, Any]


def batch_size_of(config: TrainSFTConfig) -> int:
    return AUTO_BATCH_SIZE if config.batch_size == "auto" else int(config.batch_size)


def plan_sft(trajectories: list[Trajectory], config: TrainSFTConfig, renderer: Renderer, max_length: int,
             vocabulary: int) -> SFTPlan:
    """The step's batches of sequences and each one's learning rate; refuses the whole step
    (nothing trained) if any trajectory cannot be trained on."""
    if not trajectories:
        raise SFTRequestError("train_sft got no trajectories: pass at least one demonstration")
    size = batch_size_of(config)
    stats = SFTStats()
    batches: list[list[TrainSequence]] = []
    for start in range(0, len(trajectories), size):
        batch: list[TrainSequence] = []
        for i in range(start, min(start + size, len(trajectories))):
            batch += trajectory_sequences(trajectories[i], f"trajectory {i}", renderer, config.assistant_turns,
                                          max_length, vocabulary, stats)
        batches.append(batch)
    rates = config.learning_rate if isinstance(config.learning_rate, list) else [config.learning_rate] * len(batches)
    if len(rates) < len(batches):
        raise SFTRequestError(f"learning_rate lists {len(rates)} rates, but {len(trajectories)} trajectories in "
                              f"batches of {size} make {len(batches)} batches: give one rate per batch, or a single "
                              "rate for all")
    metrics: dict[str, Any] = {
        "kind": "sft", "trajectories": len(trajectories), "batch_size": size, "optimizer_steps": len(batches),
        "assistant_turns": config.assistant_turns, "sequences": stats.sequences,
        "prefix_breaks": stats.prefix_breaks, "sequences_truncated": stats.truncated,
        "histories/exact": stats.exact_histories, "histories/rendered": stats.rendered_histories,
        "tokens/assistant": stats.trained_tokens, "tokens/total": sum(len(s) for b in batches for s in b),
        "learning_rate": rates[0], "learning_rate/last": rates[len(batches) - 1],
    }
    if len(rates) > len(batches):
        metrics["note"] = (f"learning_rate listed {len(rates)} rates for {len(batches)} batches: the first "
                           f"{len(batches)} were used")
    return SFTPlan(batches, rates[:len(batches)], metrics)
