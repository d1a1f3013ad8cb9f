"""Token-in continuation: a chat prompt that replays an earlier turn reuses that turn's exact ids.

Why: the server renders messages to text and tokenizes the text. A model's reply is often not
the canonical tokenization of its own text (a grammar-forced tool call spells `get_time` as
`t` + `ime`; a sampled reply picks any split), so re-tokenizing the next turn's prompt would
not extend the previous prompt + completion ids. The trainer (`training/tokenize.py`) would
then count a prefix break and start a new sequence, re-adding the whole earlier prompt as
untrained context, and the engine's KV prefix store would miss. vLLM users get the same
continuity by sending token ids back ("token-in"); here the OpenAI API stays unchanged.

How: every finished choice is remembered as the text and ids of its prompt + completion (its
end-of-turn token included, so the template's `<|im_end|>` after an assistant turn is part of the
match and only what follows it, e.g. `\\n<|im_start|>user`, is tokenized anew). A new prompt
whose text starts with a remembered turn's text keeps that turn's ids for that part (the longest
such turn wins) and tokenizes only the rest. The ids are checked by decoding: a prompt that would
not decode to exactly the rendered text falls back to plain tokenization, so continuation can
change how a prompt is split, never what it says. Turns are the same for every adapter of one
base model (one tokenizer), so the model name plays no part.

Rollouts of one group often write the same reply with other ids (a grammar-forced tool call is
spelt by sampled splits): one text, several turns. A prompt then continues the turn whose tool
calls it carries back (the ids of the calls the server made for that choice), so each rollout
goes on from its own tokens; without such a call, the turn with the smallest ids, so which one is
never decided by which rollout happened to finish last (a seeded run repeats).

Used by `chat_service.ChatService`: `tokenize` where it builds a request's prompt ids, `remember`
when a choice finishes.
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from art_backend.chat_format import encode_prompt

logger = logging.getLogger(__name__)

# 16 MiB: room for hundreds of multi-turn conversations in flight (a turn of 2,000 tokens takes
# about 16 KiB: 4 bytes an id, and its text).
DEFAULT_BUDGET_BYTES = 16 << 20


def turn_bytes(text: str, ids: array[int]) -> int:
    """What a remembered turn holds: its ids (4 bytes each) and its text as Python stores it."""
    return ids.itemsize * len(ids) + sys.getsizeof(text)


@dataclass(frozen=True)
class _Turn:
    ids: array[int]
    call_ids: frozenset[str]  # the tool calls the server made in this choice


class TokenContinuations:
    """Recent turns (prompt + completion) by their text, for prompts that continue them.

    Bounded by the bytes held (least recently used texts go first); safe to call from several
    threads.
    """

    def __init__(self, tokenizer: Any, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._tokenizer = tokenizer
        self.budget_bytes = budget_bytes
        # text -> its turns by their ids' bytes (one text, several splits: see the module's docstring)
        self._turns: OrderedDict[str, dict[bytes, _Turn]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(turns) for turns in self._turns.values())

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def decode(self, ids: Sequence[int]) -> str:
        """Exactly the text `ids` stand for: special tokens kept, no clean-up of spaces."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def remember(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], call_ids: Iterable[str] = ()) -> None:
        """Keep a finished choice, so a prompt that replays it continues its exact ids; `call_ids`:
        the ids of the tool calls the choice made, which a prompt continuing it carries back."""
        ids = array("i", prompt_ids)
        ids.extend(completion_ids)
        if not completion_ids or ids.itemsize * len(ids) > self.budget_bytes:
            return
        text = self.decode(ids)  # outside the lock: the costly part
        size = turn_bytes(text, ids)
        if size > self.budget_bytes:
            return
        key = ids.tobytes()
        with self._lock:
            turns = self._turns.pop(text, {})
            previous = turns.pop(key, None)
            calls = frozenset(call_ids)
            if previous is not None:  # two rollouts that drew the very same ids: each one's calls lead here
                self._bytes -= size
                calls |= previous.call_ids
            turns[key] = _Turn(ids, calls)
            self._turns[text] = turns
            self._bytes += size
            while self._bytes > self.budget_bytes:
                evicted_text, evicted = self._turns.popitem(last=False)
                self._bytes -= sum(turn_bytes(evicted_text, turn.ids) for turn in evicted.values())

    def tokenize(self, text: str, call_ids: Collection[str] = ()) -> list[int]:
        """`text`'s prompt ids: a remembered turn's exact ids for the longest part of `text` that
        replays one (of several with that text, the one whose tool calls are among `call_ids`),
        then the plain tokenization of the rest; all of it plain if none matches or the result
        would not decode to `text`."""
        match = self._longest_turn_in(text, call_ids)
        if match is None:
            return encode_prompt(self._tokenizer, text)
        turn_text, turn_ids = match
        ids = turn_ids.tolist() + encode_prompt(self._tokenizer, text[len(turn_text):])
        if self.decode(ids) != text:
            logger.warning("A continued prompt did not decode to the rendered text; tokenizing it plainly")
            return encode_prompt(self._tokenizer, text)
        return ids

    def _longest_turn_in(self, text: str, call_ids: Collection[str]) -> tuple[str, array[int]] | None:
        with self._lock:
            best: str | None = None
            for turn_text in self._turns:
                end = len(turn_text)
                # A plain scan. Turns of one conversation or group share their start (the system
                # prompt) and differ near their end, so the end is compared first.
                if (len(best or "") < end <= len(text) and text.endswith(turn_text[-16:], 0, end)
                        and text.startswith(turn_text)):
                    best = turn_text
            if best is None:
                return None
            self._turns.move_to_end(best)
            turns = self._turns[best].values()
            own = [turn for turn in turns if not turn.call_ids.isdisjoint(call_ids)]
            return best, min(own or turns, key=lambda turn: turn.ids).ids  # arrays compare item by item
