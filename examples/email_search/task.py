"""Scenarios and the reward for the email-search agent.

A scenario is a question about the user's inbox that exactly one email answers (what time is
the budget meeting, what did my kettle cost). Training and held-out questions come from
different inboxes. The reward gives partial credit for each part of the job, so the rollouts
of a small model score differently within a group (the signal GRPO learns from):

    0.50  the answer is right (the expected value appears in it)
    0.10  share of the expected answer's words it got (e.g. "3:30" of "3:30 PM")
    0.15  the answering email is cited in `sources`
    0.10  a search surfaced the answering email
    0.10  the agent read the answering email
    0.05  fewer model calls, for a right answer only (a fast wrong answer is not efficient)
   -0.05  per message id that is not in the inbox (read or cited), at most two
   -0.05  per malformed step (a call the tool rejected, a reply without a tool call, no answer), at most two

clipped to [0, 1]. Each part is kept as a trajectory metric. The penalties are small so that a
search that found the email still beats one that found nothing when both made an id up.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from examples.email_search.inbox import generate_inbox, inbox_names, read, search

MAX_MODEL_CALLS = 4  # search, read, answer, and one spare: CPU rollouts stay short
MIN_MODEL_CALLS = 3  # search, read, answer


@dataclass(frozen=True)
class Scenario:
    id: str
    inbox: str
    question: str
    answer: str
    message_id: str  # the email that answers it


def scenarios(split: str, count: int, seed: int = 0) -> list[Scenario]:
    """`count` questions from the split's inboxes (train and held-out "val" share none), drawn by `seed`."""
    pool = [q for inbox in inbox_names(split) for q in generate_inbox(inbox)[1]]
    rng = random.Random(f"{split}-{seed}")
    picked = [q for _ in range(count // len(pool) + 1) for q in rng.sample(pool, len(pool))][:count]
    return [Scenario(f"{split}-{i}", q.inbox, q.question, q.answer, q.message_id) for i, q in enumerate(picked)]


@dataclass
class Episode:
    """What the agent did, as the reward needs it."""

    searches: list[str] = field(default_factory=list)  # the keywords of each search
    reads: list[str] = field(default_factory=list)  # message ids passed to read_email
    answer: str | None = None  # None: never called return_final_answer
    sources: list[str] = field(default_factory=list)
    model_calls: int = 0
    malformed: int = 0  # tool calls the tools rejected, replies without a tool call


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def answer_is_right(expected: str, answer: str) -> bool:
    """The expected value, ignoring case, spaces and punctuation: "$59.49" matches "59.49 dollars"."""
    return "".join(_words(expected)) in "".join(_words(answer))


def score(scenario: Scenario, episode: Episode) -> dict[str, float]:
    answer = episode.answer or ""
    right = answer_is_right(scenario.answer, answer)
    expected = _words(scenario.answer)
    overlap = sum(w in _words(answer) for w in expected) / len(expected)
    cited = scenario.message_id in (s.strip() for s in episode.sources)
    found = any(scenario.message_id in {hit.message_id for hit in search(scenario.inbox, keywords)}
                for keywords in episode.searches)
    read_it = scenario.message_id in (r.strip() for r in episode.reads)
    unknown_ids = sum(read(scenario.inbox, i) is None for i in {*episode.reads, *episode.sources})
    malformed = episode.malformed + (episode.answer is None)
    # 1 for answering after search + read, 0 for using the spare call; only a right answer earns it
    fewer_calls = (MAX_MODEL_CALLS - episode.model_calls) / (MAX_MODEL_CALLS - MIN_MODEL_CALLS) if right else 0.0
    fewer_calls = max(0.0, min(1.0, fewer_calls))
    reward = (0.5 * right + 0.1 * overlap + 0.15 * cited + 0.1 * found + 0.1 * read_it + 0.05 * fewer_calls
              - 0.05 * min(unknown_ids, 2) - 0.05 * min(malformed, 2))
    return {"answer_right": float(right), "answer_overlap": overlap, "cited_source": float(cited),
            "found_email": float(found), "read_email": float(read_it), "fewer_calls": fewer_calls,
            "unknown_ids": float(unknown_ids), "malformed": float(malformed), "model_calls": float(episode.model_calls),
            "reward": max(0.0, min(1.0, reward))}
