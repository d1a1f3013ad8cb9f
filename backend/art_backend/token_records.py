"""The store behind `/v1/art/token_records`, apart from both services that fill it: chat and text
completions keep their choices' exact tokens here alike, under the id the client sees, so one route
answers for either.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

from art_backend.engine.base import TokenLogprob
from art_backend.protocol import reportable_logprobs


class TokenRecords:
    """The exact tokens of recent choices, by choice id, for clients that cannot see the
    response body: LangChain's ChatOpenAI drops `token_ids`, but keeps the message `id`, so a
    callback handler can fetch the tokens of the calls it saw afterwards. Held compactly (4 bytes
    an id, 8 a logprob) within `budget_bytes`, least recently added out."""

    def __init__(self, budget_bytes: int = 256 << 20) -> None:
        self.budget_bytes = budget_bytes
        self._records: OrderedDict[str, tuple[str, array[int], array[int], array[float]]] = OrderedDict()
        self._bytes = 0

    @staticmethod
    def _size(record: tuple[str, array[int], array[int], array[float]]) -> int:
        return sum(part.itemsize * len(part) for part in record[1:])  # type: ignore[union-attr]

    def add(self, choice_id: str, model: str, prompt_ids: list[int], token_ids: list[int],
            logprobs: list[TokenLogprob]) -> None:
        record = (model, array("i", prompt_ids), array("i", token_ids), array("d", reportable_logprobs(logprobs)))
        self._records[choice_id] = record
        self._bytes += self._size(record)
        while self._bytes > self.budget_bytes and self._records:
            self._bytes -= self._size(self._records.popitem(last=False)[1])

    def get(self, choice_id: str) -> dict[str, Any] | None:
        record = self._records.get(choice_id)
        if record is None:
            return None
        model, prompt_ids, token_ids, logprobs = record
        return {"model": model, "prompt_token_ids": prompt_ids.tolist(), "token_ids": token_ids.tolist(),
                "logprobs": logprobs.tolist()}

