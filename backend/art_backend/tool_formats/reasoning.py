"""Reasoning written between `<think>` and `</think>` (Qwen3, QwQ, DeepSeek-R1 and its distills),
returned apart from the answer as `reasoning_content`, split as vLLM's qwen3 and deepseek_r1
reasoning parsers split it: a reply reasons until `</think>` (opening with `<think>` or not, since
some templates open the block in the generation prompt), and what follows is its content, both
as written. A prompt that closed an empty block (Qwen3 with `enable_thinking: false`) means no
reasoning at all."""

from __future__ import annotations

from typing import ClassVar

from art_backend.tool_formats.base import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


class ThinkReasoning:
    names: ClassVar[tuple[str, ...]] = ("qwen3", "deepseek_r1")  # vLLM's --reasoning-parser names
    start = THINK_START
    end = THINK_END

    def opened_by(self, prompt: str) -> bool | None:
        """True: the prompt left a block open; False: it closed one (thinking off); None: the reply
        opens one itself."""
        tail = prompt.rstrip()
        if tail.endswith(self.start):
            return True
        if tail.endswith(self.end):
            return False
        return None

    def split(self, text: str, opened: bool | None) -> tuple[str | None, str | None]:
        """-> (reasoning, content); None where there is none."""
        if opened is False:
            return None, text
        body = text.removeprefix(self.start)
        reasoning, closed, content = body.partition(self.end)
        return reasoning, (content or None) if closed else None


class ReasoningStream:
    """Splits streamed reply text into reasoning and content deltas as it comes, holding back only
    what could be a marker, so that the deltas add up to what `split` returns."""

    def __init__(self, reasoning: ThinkReasoning, opened: bool | None) -> None:
        self._reasoning = reasoning
        self._in_reasoning = opened is not False
        self._at_start = opened is not False  # where a `<think>` may still open the reply
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        self._pending += delta
        if not self._in_reasoning:
            content, self._pending = self._pending, ""
            return "", content
        if self._at_start:
            if self._reasoning.start.startswith(self._pending):
                return "", ""
            self._pending, self._at_start = self._pending.removeprefix(self._reasoning.start), False
        reasoning, closed, content = self._pending.partition(self._reasoning.end)
        if closed:
            self._in_reasoning, self._pending = False, ""
            return reasoning, content
        held = partial_suffix(reasoning, self._reasoning.end)
        self._pending = reasoning[len(reasoning) - held:]
        return reasoning[:len(reasoning) - held], ""

    def finish(self) -> tuple[str, str]:
        pending, self._pending = self._pending, ""
        if self._at_start and pending == self._reasoning.start:
            return "", ""
        return (pending, "") if self._in_reasoning else ("", pending)
