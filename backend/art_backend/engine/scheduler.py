"""The torch engine's scheduler: which waiting requests to prefill together, which KV each reuses,
which slot each active sequence reads its prompt's start from, and what a finished one leaves.

Continuous batching as vLLM's scheduler does it, at the torch engine's scale: every iteration
admits waiting requests (`next_prefill_batch`), then all active sequences decode one token
together. Active sequence i lives in KV slot i. A request's prompt is prefilled only past the
longest KV prefix some active sequence or the prefix cache holds for it; rollouts of a group,
which share their prompt, go into separate prefill batches so that the later ones copy the first
one's KV instead of recomputing it. During decode, a sequence whose prompt starts with at least
`MIN_SHARED_KV` tokens of another active one's (same adapter, so the same numbers) reads those
keys and values from the other's slot (its leader's) instead of its own copy.
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from art_backend.engine.kv_cache import KVCache
from art_backend.engine.llama import LoraWeights
from art_backend.engine.prefix_cache import PrefixCache, common_prefix
from art_backend.engine.sequence import ActiveSequence, QueuedRequest

# the fewest prompt tokens whose keys and values a sequence reads from another's slot
MIN_SHARED_KV = 64


# a cached KV prefix: its length, and who holds it (an active sequence or a prefix-cache key)
PrefixHit = tuple[int, ActiveSequence | tuple[int, ...] | None]


class Scheduler:
    def __init__(self, max_batch_size: int, prefixes: PrefixCache, lock: threading.Condition) -> None:
        self.max_batch_size = max_batch_size
        self.prefixes = prefixes
        self.waiting: deque[QueuedRequest] = deque()  # appended under `lock` by any thread
        self.active: list[ActiveSequence] = []  # the engine thread's only; active[i] is in KV slot i
        self._lock = lock

    def find_prefix(self, tokens: list[int], adapter: LoraWeights | None) -> PrefixHit:
        """The longest KV prefix of `tokens` held by an active sequence or the prefix cache (at
        most all but the last token: its logits choose the first new token), and its holder."""
        best: int = 0
        source: ActiveSequence | tuple[int, ...] | None = None
        for seq in self.active:
            if seq.request.adapter is adapter:
                n = common_prefix(seq.ids[:-1], tokens)
                if n > best:
                    best, source = n, seq
        kept, key = self.prefixes.longest(tokens, adapter, longer_than=best)
        if key is not None:
            best, source = kept, key
        return min(best, len(tokens) - 1), source

    def copy_prefix(self, hit: PrefixHit, cache: KVCache, slot: int) -> int:
        """Copy a prefix found by `find_prefix` into `slot`; return its length."""
        best, source = hit
        if best <= 0:
            return 0
        if isinstance(source, ActiveSequence):
            cache.move(self.active.index(source), slot, best)
        else:
            assert source is not None
            self.prefixes.load(source, cache, slot, best)
        return best

    def next_prefill_batch(self) -> list[tuple[QueuedRequest, PrefixHit]]:
        """Waiting requests to prefill in one forward, in arrival order. The batch ends before a
        request that shares more of its prompt with one already taken than any cached KV covers
        (next batch, it reuses that KV instead of recomputing it: a group's rollouts share their
        prompt), or whose padding would make over half of the forward's tokens padding. Each
        request comes with the cached KV prefix it will reuse."""
        batch: list[tuple[QueuedRequest, PrefixHit]] = []
        seats, new_tokens, widest = len(self.active), 0, 0
        with self._lock:
            for request in list(self.waiting):
                if request.aborted:
                    self.waiting.remove(request)
                    continue
                if (self.active or batch) and seats + request.spec.n > self.max_batch_size:
                    break
                prompt = request.spec.prompt_ids
                hit = self.find_prefix(prompt, request.adapter)
                cached = hit[0]
                shared = max((common_prefix(other.spec.prompt_ids, prompt) for other, _ in batch
                              if other.adapter is request.adapter), default=0)
                shared = min(shared, len(prompt) - 1)  # the last token is recomputed anyway
                if shared > 1 and shared > cached:
                    break
                new = len(prompt) - cached
                if batch and (len(batch) + 1) * max(widest, new) > 2 * (new_tokens + new):
                    break
                self.waiting.remove(request)
                batch.append((request, hit))
                seats, new_tokens, widest = seats + request.spec.n, new_tokens + new, max(widest, new)
        return batch

    def find_leader(self, seq: ActiveSequence) -> None:
        """The active sequence sharing the longest start of `seq`'s prompt (and its adapter), at
        least `MIN_SHARED_KV` tokens, or none: a group's rollouts, and the requests that start
        with the same system prompt and tools."""
        seq.leader, seq.shared = None, 0
        prompt = seq.ids[:-1]  # the last prompt token's keys are its own step's
        for other in self.active:
            if other is not seq and other.request.adapter is seq.request.adapter:
                n = common_prefix(other.ids[:-1], prompt)
                if n >= MIN_SHARED_KV and n > seq.shared:
                    seq.leader, seq.shared = other, n

    def shared_kv(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For a decode step: each row's leader's slot and how many keys it reads there (its own
        slot and 0 without one); a leader that has finished is replaced first."""
        slot_of = {id(seq): slot for slot, seq in enumerate(self.active)}
        slots, lengths = [], []
        for slot, seq in enumerate(self.active):
            if seq.leader is not None and id(seq.leader) not in slot_of:
                self.find_leader(seq)
            leader = seq.leader
            slots.append(slot if leader is None else slot_of[id(leader)])
            lengths.append(0 if leader is None else seq.shared)
        return torch.tensor(slots, device=device), torch.tensor(lengths, device=device)

    def retire(self, cache: KVCache) -> None:
        """Take the finished sequences out, keeping their KV in the prefix cache; the last active
        sequence moves into each freed slot, so slots stay 0..B-1."""
        for seq in [s for s in self.active if s.finish_reason]:
            slot = self.active.index(seq)
            self.prefixes.keep(seq.ids, seq.request.adapter, cache, slot)
            last = len(self.active) - 1
            if slot != last:
                cache.move(last, slot, len(self.active[last].ids) - 1)
                self.active[slot] = self.active[last]
            self.active.pop()
