"""The interface between the HTTP layer and a model engine.

The server only ever calls these methods, so the embedded torch engine (`torch_engine.py`) and
the vLLM engine (`vllm_engine.py`) are interchangeable behind it: prompts arrive as token ids,
the engines sample and report logprobs the same way. Training is the training service's
(`training/`): an engine only says where a step may run (`run_training`) and whether the trainer
may train its own copy of the model (`lent_model`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from art_backend.chat_format import ChatFormatter
    from art_integrations.training import LoraConfig


@dataclass(frozen=True)
class SamplingParams:
    """How to draw a reply (see `art_backend.engine.sampling` for the order the engines apply them in)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = True  # the sampled tokens' logprobs are wanted (False: an engine may leave them out)
    top_logprobs: int = 0  # alternatives returned per token besides the sampled one
    ignore_eos: bool = False  # keep going past end-of-turn tokens (benchmarks)
    grammar: str | None = None  # an llguidance grammar the output must follow (see art_backend.grammar)
    skip_special_tokens: bool = True  # leave special tokens out of the text (False: a family's call markup needs them)


@dataclass(frozen=True)
class GenerationRequest:
    """`n` samples continuing `prompt_ids`."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    model: str | None = None  # a served adapter name; None = the base model


LOWEST_LOGPROB = -9999.0  # what OpenAI and vLLM's server report for a token that could not be drawn


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class LentModel:
    """An engine's own Hugging Face model, lent to the trainer to train in place (no second copy of
    the weights), with the allocator a step may reuse its freed memory through (host_memory.py).
    `trainer`: set by the training service at its first step; peft wraps `model` in place, so every
    service training it (tests share one engine) shares that one trainer."""

    model: Any
    step_memory: Any | None = None
    trainer: Any | None = None


@dataclass
class SequenceDelta:
    """New output of one sample since its previous delta."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token, or none when they were not wanted
    text: str
    finish_reason: str | None = None  # "stop" | "length" once finished


def end_of_turn_ids(tokenizer: Any, generation_eos: int | list[int] | None) -> set[int]:
    """The tokens that end a reply: the tokenizer's EOS, the model's generation-config EOS ids, and
    ChatML's `<|im_end|>` where the vocabulary has it (some ChatML models name another EOS)."""
    ids = {tokenizer.eos_token_id}
    ids.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return {i for i in ids if i is not None}


def is_base_model(engine: Engine, model: str | None) -> bool:
    """Whether a request for `model` runs on the base model alone: no name, its name or an alias."""
    return model is None or model == engine.base_model_name or model in engine.base_model_aliases


class Engine(Protocol):
    base_model_name: str  # the name /v1/models lists first and trained models record
    # further names of the base model (a hub id's repo name, a directory as typed), served as it
    base_model_aliases: tuple[str, ...]
    model_dir: Path  # the base model's weights, tokenizer and config
    max_model_len: int
    tokenizer: Any  # a transformers tokenizer with the model's chat template

    def chat_formatter(self, tool_call_parser: str | None, reasoning_parser: str | None) -> ChatFormatter:
        """The renderer and reply reader for this engine's model (vLLM's own parsers on the vLLM engine)."""
        ...

    def served_models(self) -> list[str]:
        """Names accepted as `model`: the base model first, its aliases, then adapters."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[SequenceDelta]:
        """Stream deltas for all samples of `request`; closing the iterator aborts them."""
        ...

    async def load_adapter(self, name: str, path: Path | None, preload: bool = True) -> None:
        """Serve the peft LoRA adapter saved at `path` under `name` (replacing a same-named one);
        `path=None` serves the base model under `name`. `preload=False`: read it on first use (a
        run's older checkpoints, which may be many and are seldom asked for)."""
        ...

    async def remove_adapter(self, name: str) -> None: ...

    def check_lora(self, lora: LoraConfig) -> None:
        """Raise ValueError, naming the setting to change, if adapters of this shape cannot be served."""
        ...

    def lent_model(self) -> LentModel | None:
        """The model the trainer trains in place, or None: the trainer loads its own copy of
        `model_dir` (beside vLLM's weights)."""
        ...

    async def run_training(self, step: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Run the blocking training `step` where and when this engine lets one run; requests wait
        meanwhile and none fails. Its metrics, with `wait_seconds` (how long it waited to start)
        and what pausing the engine cost, where it does."""
        ...

    async def close(self) -> None: ...
