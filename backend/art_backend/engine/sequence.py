"""What the torch engine knows of a request while it waits, and of each of its sequences while
they decode (a request asks for `n`)."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field

import llguidance

from art_backend.engine.base import GenerationRequest, SequenceDelta, TokenLogprob
from art_backend.engine.detokenizer import IncrementalText
from art_backend.engine.llama import LoraWeights
from art_backend.engine.sampling import Penalties, RowSampling


@dataclass(eq=False)
class QueuedRequest:
    spec: GenerationRequest
    adapter: LoraWeights | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[list[SequenceDelta] | BaseException]
    aborted: bool = False


@dataclass(eq=False)
class ActiveSequence:
    request: QueuedRequest
    index: int
    ids: list[int]  # prompt + completion; the cache holds KV for all but the last
    completion: list[int]
    rows: RowSampling
    text: IncrementalText
    matcher: llguidance.LLMatcher | None = None  # the grammar the output must follow
    penalties: Penalties | None = None
    pending: list[TokenLogprob] = field(default_factory=list)  # not yet sent
    finish_reason: str | None = None
    # an active sequence whose slot holds this one's first `shared` keys and values too (see scheduler.py)
    leader: ActiveSequence | None = None
    shared: int = 0

    def append(self, token: TokenLogprob, end_of_turn: Collection[int], max_model_len: int) -> None:
        """Take in the sampled `token`: its text, and whether the sequence ends here (its
        end-of-turn token, a stop string, `max_tokens` or the context)."""
        params = self.request.spec.params
        self.ids.append(token.token_id)
        self.completion.append(token.token_id)
        self.pending.append(token)
        if token.token_id in end_of_turn and not params.ignore_eos:
            self.finish_reason = "stop"
            self.text.finish(self.completion[:-1])  # the end-of-turn token is no text
            return
        if self.text.add(self.completion):
            self.finish_reason = "stop"
        elif len(self.completion) >= params.max_tokens or len(self.ids) >= max_model_len:
            self.finish_reason = "length"
            self.text.finish(self.completion)

    def delta(self) -> SequenceDelta | None:
        """What the client has not been sent yet (None: nothing)."""
        text = self.text.unsent(finished=self.finish_reason is not None)
        if not self.pending and not text and self.finish_reason is None:
            return None
        delta = SequenceDelta(index=self.index, token_ids=[t.token_id for t in self.pending], logprobs=self.pending,
                              text=text, finish_reason=self.finish_reason)
        self.pending = []
        return delta
