"""The embedded model's conversion from its GGUF gives the tokenizer SmolLM2 releases, whatever
transformers release converts it: vLLM's grammars (llguidance) read its vocabulary as byte-level BPE,
and <|im_end|> ends a turn. transformers 5.17 (the GPU machine's) converted it otherwise, and every
forced tool call on vLLM failed there."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance.hf
from art_backend.model_store import _as_released
from tokenizers import decoders
from transformers import AutoTokenizer

NEWLINE = "\u010a"  # byte-level BPE's spelling of "\n"


def newline_bytes(tokenizer) -> bytes:
    grammar_vocabulary = llguidance.hf.from_tokenizer(tokenizer, len(tokenizer))
    return grammar_vocabulary.decode_bytes([tokenizer.convert_tokens_to_ids(NEWLINE)])


def test_the_converted_tokenizer_is_byte_level_for_grammars_and_ends_turns_with_im_end(
        embedded_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    assert newline_bytes(tokenizer) == b"\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|im_end|>"
    for name in ("config.json", "generation_config.json"):
        assert json.loads((embedded_model_dir / name).read_text())["eos_token_id"] == tokenizer.eos_token_id


def test_a_tokenizer_converted_as_transformers_5_17_did_is_put_back(embedded_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    # what transformers 5.17's GGUF conversion wrote (read on the GPU machine's image)
    tokenizer.backend_tokenizer.decoder = decoders.Sequence([
        decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("\u2581", " "), decoders.ByteLevel()])
    tokenizer.eos_token = "<|im_start|>"
    assert newline_bytes(tokenizer) == NEWLINE.encode()  # the raw string: a grammar's "\n" rejects it

    repaired = _as_released(tokenizer)
    assert newline_bytes(repaired) == b"\n"
    assert repaired.eos_token == "<|im_end|>"
    text = 'Hi <tool_call>\n{"city": "Paris"}\n</tool_call> café 日本'
    assert repaired.decode(repaired(text).input_ids) == text
