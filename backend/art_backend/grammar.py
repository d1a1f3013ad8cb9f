"""Grammars for constrained decoding: tool calls the reply must make, and JSON output.

The embedded engine enforces them with llguidance (chosen over xgrammar by
`benchmarks/bench_grammar.py`: both compute a token mask in well under a millisecond, but
llguidance compiles a new schema ~8x faster, and every request brings its own schema).
Grammars are llguidance lark text (JSON schemas embedded with `%json`): the torch engine
builds matchers from it, and the vLLM engine hands the same text to vLLM's structured outputs
(guidance backend) as a grammar, so both engines enforce exactly the same structure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
import llguidance.hf
# llguidance.numpy, not llguidance.torch: the torch module decorates a kernel we do not use with
# torch.compile, whose import (torch._dynamo, sympy, networkx) was ~40% of a backend's start
import llguidance.numpy
import torch

from art_backend.errors import GrammarError
from art_backend.tool_formats.base import CallMarkup


# json.dumps's layout, the one chat_format renders tool calls with: a call the model made then
# re-renders to the same text, so the next turn's prompt extends this turn's tokens; and no
# stretch of whitespace for a small model to lose itself in.
_LAYOUT = {"x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
_DEFINITIONS = ("$defs", "definitions")


def _rebased(value: Any, old: str, new: str) -> Any:
    """`value` with every `$ref` to `old`... pointing to `new`... instead."""
    if isinstance(value, dict):
        return {key: (new + item[len(old):] if key == "$ref" and isinstance(item, str) and item.startswith(old)
                      else _rebased(item, old, new)) for key, item in value.items()}
    if isinstance(value, list):
        return [_rebased(item, old, new) for item in value]
    return value


def _call_schema(tool: dict[str, Any], index: int, arguments_key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The JSON schema of a call of `tool`, and the definitions its `$ref`s need, moved to the
    root of the grammar's schema (where `#/$defs/...` resolves) under names of this tool's own."""
    function = tool.get("function", tool)
    parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
    definitions: dict[str, Any] = {}
    for key in _DEFINITIONS:
        for name, schema in (parameters.pop(key, None) or {}).items():
            definitions[f"tool{index}_{name}"] = schema
        parameters = _rebased(parameters, f"#/{key}/", f"#/$defs/tool{index}_")
    definitions = {name: _rebased(_rebased(schema, "#/$defs/", f"#/$defs/tool{index}_"), "#/definitions/",
                                  f"#/$defs/tool{index}_") for name, schema in definitions.items()}
    # Arguments the tool does not declare cannot be passed to it; without this a small model
    # keeps inventing keys until it runs out of tokens (as OpenAI's strict mode, unless the
    # schema says otherwise).
    parameters.setdefault("additionalProperties", False)
    return ({"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
             "required": ["name", arguments_key], "additionalProperties": False}, definitions)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a lark string literal is a JSON string literal


def _lark_text(text: str, added_tokens: Mapping[str, int]) -> str:
    """`text` as grammar items: the tokenizer's added tokens (`<tool_call>` in Qwen's, `[TOOL_CALLS]`
    in Mistral's) as those very tokens, since a model writes them so and the grammar engine never
    spells them from text, and the rest as text."""
    found = [token for token in added_tokens if token and token in text]
    if not found:
        return _lark_string(text) if text else ""
    pattern = re.compile("(" + "|".join(map(re.escape, sorted(found, key=len, reverse=True))) + ")")
    items = [f"<[{added_tokens[part]}]>" if part in added_tokens else _lark_string(part)
             for part in pattern.split(text) if part]
    return " ".join(items)


def tool_call_grammar(tools: list[dict[str, Any]], parallel: bool, markup: CallMarkup,
                      added_tokens: Mapping[str, int], reasoning: tuple[str, str, bool] | None = None) -> str:
    """Exactly a family's call markup around a JSON call of one of `tools` (several if `parallel`).
    `reasoning` (start, end, already opened by the prompt) lets a reasoning block come first; its
    markers must be single tokens, so that its free text cannot run past the end marker."""
    calls = [_call_schema(tool, index, markup.arguments_key) for index, tool in enumerate(tools)]
    schemas = [schema for schema, _ in calls]
    schema = {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), **_LAYOUT}
    definitions = {name: definition for _, found in calls for name, definition in found.items()}
    if definitions:
        schema["$defs"] = definitions
    def items(*parts: str) -> str:
        return " ".join(part for part in parts if part)

    text = {field: _lark_text(getattr(markup, field), added_tokens)
            for field in ("before", "open", "close", "between", "after")}
    start = items(text["before"], "call", f"({items(text['between'], 'call')})*" if parallel else "", text["after"])
    rules = [f"call: {items(text['open'], 'body', text['close'])}", f"body: %json {json.dumps(schema)}"]
    if reasoning is not None:
        begin, end, opened = reasoning
        if begin in added_tokens and end in added_tokens:
            opening = "" if opened else f"<[{added_tokens[begin]}]>"
            # the space after it is bounded: a small model might never stop writing it
            rules.append(f"think: {items(opening, '/(?s:.*)/', f'<[{added_tokens[end]}]>')} /[ \\t\\n]{{0,4}}/")
            start = f"think{'' if opened else '?'} {start}"
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _json_lark(schema: dict[str, Any]) -> str:
    return f"start: %json {json.dumps({**schema, **_LAYOUT})}\n"


def json_grammar(response_format: dict[str, Any]) -> str | None:
    """OpenAI `response_format` -> grammar; None for plain text."""
    kind = response_format.get("type")
    if kind == "json_object":
        return _json_lark({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("response_format.json_schema.schema must be a JSON schema object")
        return _json_lark(schema)
    return None


class Constrainer:
    """Makes per-sequence matchers for one tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)

    def check(self, grammar: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"The requested structure cannot be enforced: {error}")

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise GrammarError(f"The requested structure cannot be enforced: {matcher.get_error()}")
        return matcher

    def allowed_tokens(self, matchers: Sequence[llguidance.LLMatcher | None], vocab: int, end_of_turn: int,
                       device: torch.device) -> torch.Tensor | None:
        """[rows, vocab] bool: what each row's matcher allows next (a row without one: everything;
        one whose structure is complete, or whose parser gave up: only `end_of_turn`); None when no
        row has a matcher."""
        if all(matcher is None for matcher in matchers):
            return None
        words = llguidance.numpy.allocate_token_bitmask(len(matchers), self.tokenizer.vocab_size)
        bitmask = torch.from_numpy(words)  # the same memory
        for row, matcher in enumerate(matchers):
            if matcher is None:
                continue
            if not matcher.is_stopped():
                llguidance.numpy.fill_next_token_bitmask(matcher, words, row)
            if matcher.is_stopped() or matcher.is_error():
                bitmask[row] = 0
                bitmask[row, end_of_turn // 32] = 1 << (end_of_turn % 32)
        # unpack 32 tokens per int32 word (rows without a matcher stay all ones)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(matchers), -1)[:, :vocab].bool().to(device)
        if allowed.shape[-1] < vocab:  # padded model vocabularies: the extra ids are never valid
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[-1]))
        return allowed
