"""A sequence's text as its tokens arrive, with stop strings (the torch engine's detokenizer).

Decoding the whole completion at every token would cost its length each time; decoding only the
newest token splits multi-byte characters and drops the space a token starts with. So each step
decodes a short window (the tokens since the last whole character, as vLLM's detokenizer does)
and appends what it adds. Text that could be the start of a stop string is held back until the
next tokens rule the stop in or out, so a client never sees text that a stop string then takes
back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class IncrementalText:
    tokenizer: Any
    stop: Sequence[str]
    skip_special_tokens: bool
    text: str = ""
    sent: int = 0  # characters of `text` handed out by `unsent`
    prefix_offset: int = 0  # the window: completion[prefix_offset:] decodes to what read_offset's tokens
    read_offset: int = 0  # already gave, plus the new text

    def add(self, completion: list[int]) -> bool:
        """Take in the newest token of `completion`; True if that completes a stop string (the text
        then ends before it)."""
        decode = self.tokenizer.decode
        window = decode(completion[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        before = decode(completion[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        if len(window) <= len(before) or window.endswith("\ufffd"):  # a character still incomplete
            return False
        old_length = len(self.text)
        self.text += window[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(completion)
        for stop in self.stop:
            at = self.text.find(stop, max(0, old_length - len(stop) + 1))
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def finish(self, ids: list[int]) -> None:
        """The whole text of the finished completion `ids` (a character the window still held back
        comes out; an end-of-turn token is left out of `ids` by the caller)."""
        self.text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def unsent(self, finished: bool) -> str:
        """The text not yet handed out, less what could still turn out to start a stop string."""
        hold = 0 if finished else max((len(s) - 1 for s in self.stop), default=0)
        upto = max(self.sent, len(self.text) - hold)
        text, self.sent = self.text[self.sent:upto], upto
        return text
