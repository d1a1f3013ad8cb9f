"""Models of each family's chat format, made offline: SmolLM2's tokenizer given the family's real
chat template and special tokens (tests/fixtures/chat_families/), and a tiny random Llama over
that vocabulary, so both engines serve it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "chat_families"
FAMILIES: dict[str, dict[str, Any]] = {
    name: spec for name, spec in json.loads((FIXTURES / "families.json").read_text()).items()
    if not name.startswith("_")
}


def _family_tokenizer(family: str, source: Path) -> Any:
    from transformers import AutoTokenizer

    spec = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": spec["special"]},
                                 replace_extra_special_tokens=False)
    tokenizer.add_tokens(spec["added"])
    tokenizer.bos_token = spec["bos"]
    tokenizer.eos_token = spec["eos"]
    tokenizer.chat_template = (FIXTURES / spec["template"]).read_text()
    return tokenizer


def _save(family: str, model: Any, tokenizer: Any, out: Path) -> Path:
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids(FAMILIES[family]["generation_eos"]))
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build_family_model(family: str, tokenizer_source: Path, out: Path) -> Path:
    """A tiny random model at `out` whose tokenizer and chat template are `family`'s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _family_tokenizer(family, tokenizer_source)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return _save(family, LlamaForCausalLM(config), tokenizer, out)


def retemplate_model(family: str, model_dir: Path, out: Path) -> Path:
    """The pretrained model at `model_dir` speaking `family`'s chat format: its tokenizer given the
    family's tokens (each starting from the embedding of the token it stands in for) and template."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _family_tokenizer(family, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():  # the embeddings are tied: a row is also that token's output
        for token, like in FAMILIES[family]["embedding_from"].items():
            embeddings[tokenizer.convert_tokens_to_ids(token)] = embeddings[tokenizer.convert_tokens_to_ids(like)]
    return _save(family, model, tokenizer, out)
