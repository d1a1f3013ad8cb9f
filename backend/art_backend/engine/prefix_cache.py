"""The torch engine's prefix cache: the keys and values of finished turns, by their tokens.

The next turn of a conversation starts with the whole of the last one, and every rollout of a
group starts with the same prompt, so a finished sequence's KV is kept under its tokens and a new
request prefills only what the longest kept prefix does not cover. Entries are dropped oldest
first past a budget of bytes, and all of them once no request has come for a while (a trained
step's adapter makes the old ones useless anyway).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from art_backend.engine.kv_cache import KVCache
    from art_backend.engine.llama import LoraWeights

logger = logging.getLogger(__name__)


def common_prefix(a: list[int] | tuple[int, ...], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Entry:
    adapter: LoraWeights | None  # the numbers are this adapter's (None: the base model's)
    k: torch.Tensor
    v: torch.Tensor


class PrefixCache:
    def __init__(self, max_bytes: int, idle_seconds: float, bytes_per_token: int) -> None:
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.tokens = 0
        self.idle_seconds = idle_seconds
        self._bytes_per_token = bytes_per_token
        self._budget = max_bytes // bytes_per_token  # in tokens

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, tokens: list[int], adapter: LoraWeights | None, longer_than: int = 0
                ) -> tuple[int, tuple[int, ...] | None]:
        """The longest kept prefix of `tokens` computed with `adapter`, if longer than `longer_than`:
        its length and key."""
        best, key = longer_than, None
        for kept, entry in self._entries.items():
            if entry.adapter is adapter and len(kept) > best:
                n = common_prefix(kept, tokens)
                if n > best:
                    best, key = n, kept
        return best, key

    def load(self, key: tuple[int, ...], cache: KVCache, slot: int, length: int) -> None:
        """Copy the first `length` tokens' KV of the entry `key` into `slot` of `cache`."""
        entry = self._entries[key]
        self._entries.move_to_end(key)
        cache.load(slot, entry.k, entry.v, length)

    def keep(self, ids: list[int], adapter: LoraWeights | None, cache: KVCache, slot: int) -> None:
        """Keep the KV of a finished sequence's `ids` (all but the last: its KV was never computed),
        which `slot` of `cache` holds."""
        length = len(ids) - 1
        key = tuple(ids[:length])
        if length < 2 or key in self._entries or length > self._budget:
            return
        k, v = cache.export(slot, length)
        self._entries[key] = _Entry(adapter, k, v)
        self.tokens += length
        while self.tokens > self._budget:
            old, _ = self._entries.popitem(last=False)
            self.tokens -= len(old)

    def idle_wait(self) -> float | None:
        """How long an idle engine waits before `forget` (None: no limit, or nothing to forget)."""
        return None if not self._entries or math.isinf(self.idle_seconds) else self.idle_seconds

    def forget(self) -> None:
        logger.info("Dropped the %d kept prefixes (%.0f MiB of KV) after %.0f s without a request",
                    len(self._entries), self.tokens * self._bytes_per_token / 2**20, self.idle_seconds)
        self._entries.clear()
        self.tokens = 0
