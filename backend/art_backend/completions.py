"""`POST /v1/completions`: OpenAI's (legacy) text completions, on any engine.

Some agents and RL loops drive a model with a raw prompt (their own template, or token ids they
keep themselves). The prompt is a string (tokenized plainly, as vLLM does) or token ids (used as
they are), one per request; `n`, `max_tokens` (OpenAI's default 16), the sampling settings of
chat completions, stop strings, `logprobs` (the number of alternatives per token, OpenAI's legacy
shape) and `stream` are served. As on chat completions, with `return_token_ids` (on unless turned
off) the response carries `prompt_token_ids` and each choice's `token_ids`, and `token_record_id`,
under which `/v1/art/token_records` keeps them with their logprobs (sent along as
`token_logprobs` with the capture's token-logprobs header). `echo` and `suffix` are refused by
name: neither is implemented, and both change what comes back.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from art_backend.chat_service import ChatService, GeneratedChoice
from art_backend.continuation import encode_prompt
from art_backend.engine.base import GenerationRequest, SequenceDelta, TokenLogprob
from art_backend.errors import ContextLengthError, ModelNotServedError, UnsupportedFeatureError, error_body
from art_backend.protocol import (NOT_IMPLEMENTED, StreamOptions, now, refuse_lone_surrogates, reportable,
                                  reportable_logprobs)

logger = logging.getLogger(__name__)

# the Completions API's own fields this server does not do, each with the values that ask for nothing of it
REFUSED: dict[str, tuple[Any, ...]] = {**NOT_IMPLEMENTED, "echo": (None, False), "suffix": (None, "")}
REASONS = {"echo": "the prompt is not sent back in the text; its exact tokens come as `prompt_token_ids`",
           "suffix": "insertion (fill-in-the-middle) is not implemented"}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused or named

    model: str
    prompt: str | list[Annotated[int, Field(ge=0)]] | list[str] | list[list[Annotated[int, Field(ge=0)]]]
    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default; null: as much as the context holds
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy shape: alternatives per token
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    return_token_ids: bool = True
    ignore_eos: bool = False

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if "" in self.stop_strings:
            raise ValueError("stop holds an empty string, which would end every reply at once: leave it out")
        return self

    def refused(self) -> list[str]:
        return sorted(name for name, value in (self.model_extra or {}).items()
                      if name in REFUSED and value not in REFUSED[name])

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def one_prompt(self) -> str | list[int]:
        """The request's one prompt: a string or token ids (a list of one of either is that one)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise UnsupportedFeatureError(f"This server's /v1/completions takes one prompt per request, got "
                                              f"{len(prompt)}: send each in a request of its own (or use n).")
            return prompt[0]  # type: ignore[return-value]
        return prompt  # type: ignore[return-value]


@dataclass
class PreparedCompletion:
    body: CompletionRequest
    generation: GenerationRequest
    token_logprobs: bool  # each token's logprob beside its id (the capture's header)
    response_id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")


def prepare(service: ChatService, body: CompletionRequest, token_logprobs: bool) -> PreparedCompletion:
    engine = service.engine
    if body.model not in engine.served_models():
        raise ModelNotServedError.unknown(body.model, engine.served_models())
    refused = body.refused()
    if refused:
        why = "; ".join(f"{name}: {REASONS[name]}" for name in refused if name in REASONS)
        raise UnsupportedFeatureError(f"Not supported by this server's /v1/completions: {', '.join(refused)}"
                                      f"{f' ({why})' if why else ''}. Leave them out (or at their defaults).")
    prompt = body.one_prompt()
    if isinstance(prompt, str):
        if len(prompt) > engine.max_model_len * service._longest_token:
            raise ContextLengthError.text_over(engine.max_model_len, len(prompt))
        prompt_ids = encode_prompt(engine.tokenizer, prompt)
    else:
        vocabulary = len(engine.tokenizer)
        beyond = sorted({token for token in prompt if token >= vocabulary})
        if beyond:
            raise UnsupportedFeatureError(f"prompt holds token ids outside the vocabulary (0..{vocabulary - 1}): "
                                          f"{', '.join(map(str, beyond[:10]))}.")
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise UnsupportedFeatureError("The prompt is empty: send at least one token.")
    room = engine.max_model_len - len(prompt_ids)
    if room <= 0 or (body.max_tokens is not None and body.max_tokens > room):
        raise ContextLengthError.over(engine.max_model_len, len(prompt_ids), body.max_tokens or 0)
    params = service.sampling_params(body, body.max_tokens or room,
                                     logprobs=body.logprobs is not None or body.return_token_ids,
                                     top_logprobs=body.logprobs or 0)
    served = None if body.model == engine.base_model_name else body.model
    return PreparedCompletion(body, GenerationRequest(prompt_ids, params, body.n, served), token_logprobs)


def _legacy_logprobs(service: ChatService, entries: list[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy logprobs: tokens, their logprobs, the top alternatives and text offsets."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(service._token_text(entry.token_id))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [reportable(e.logprob) for e in entries],
            "top_logprobs": [{service._token_text(t): reportable(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def _tokens(prepared: PreparedCompletion, ids: list[int], entries: list[TokenLogprob],
            record_id: str | None) -> dict[str, Any]:
    """A choice's (or chunk's) token fields, as `return_token_ids` and the capture's header ask."""
    if not prepared.body.return_token_ids:
        return {}
    tokens: dict[str, Any] = {"token_ids": ids}
    if prepared.token_logprobs:
        tokens["token_logprobs"] = reportable_logprobs(entries)
    if record_id is not None:
        tokens["token_record_id"] = record_id
    return tokens


def _finished(service: ChatService, prepared: PreparedCompletion, sample: GeneratedChoice) -> str | None:
    """The record id under which a finished sample's exact tokens are kept (None without return_token_ids)."""
    if not prepared.body.return_token_ids:
        return None
    record_id = f"{prepared.response_id}-{sample.index}"
    service.records.add(record_id, prepared.body.model, prepared.generation.prompt_ids, sample.token_ids,
                        sample.logprobs)
    return record_id


def _usage(prepared: PreparedCompletion, completion_tokens: int) -> dict[str, int]:
    prompt_tokens = len(prepared.generation.prompt_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def complete(service: ChatService, prepared: PreparedCompletion) -> dict[str, Any]:
    body, generation = prepared.body, prepared.generation
    samples = [GeneratedChoice(i) for i in range(generation.n)]
    async for delta in service.engine.generate(generation):
        sample = samples[delta.index]
        sample.token_ids += delta.token_ids
        sample.logprobs += delta.logprobs
        sample.text += delta.text
        sample.finish_reason = delta.finish_reason or sample.finish_reason
    choices = []
    for sample in samples:
        record_id = _finished(service, prepared, sample)
        choices.append({"index": sample.index, "text": sample.text, "finish_reason": sample.finish_reason,
                        "logprobs": _legacy_logprobs(service, sample.logprobs, 0) if body.logprobs is not None
                        else None, **_tokens(prepared, sample.token_ids, sample.logprobs, record_id)})
    response: dict[str, Any] = {"id": prepared.response_id, "object": "text_completion", "created": now(),
                                "model": body.model, "choices": choices,
                                "usage": _usage(prepared, sum(len(s.token_ids) for s in samples))}
    if body.return_token_ids:
        response["prompt_token_ids"] = generation.prompt_ids
    return response


async def stream(service: ChatService, prepared: PreparedCompletion) -> AsyncIterator[str]:
    """The completion as server-sent events: a chunk per delta, the prompt's ids on the first, each
    choice's record id on its last; `[DONE]` at the end."""
    body, generation = prepared.body, prepared.generation
    base = {"id": prepared.response_id, "object": "text_completion", "created": now(), "model": body.model}
    samples = [GeneratedChoice(i) for i in range(generation.n)]
    first = True
    completion_tokens = 0
    try:
        async for delta in service.engine.generate(generation):
            chunk = _stream_chunk(service, prepared, samples, delta, first)
            completion_tokens += len(delta.token_ids)
            first = False
            yield f"data: {json.dumps({**base, **chunk})}\n\n"
    except Exception as error:  # headers are sent: report in-band, as the chat stream (and vLLM) does
        logger.exception("Generation failed mid-stream")
        yield f"data: {json.dumps(error_body(str(error), 'InternalServerError', code=500))}\n\n"
        return
    if body.stream_options is not None and body.stream_options.include_usage:
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': _usage(prepared, completion_tokens)})}\n\n"
    yield "data: [DONE]\n\n"


def _stream_chunk(service: ChatService, prepared: PreparedCompletion, samples: list[GeneratedChoice],
                  delta: SequenceDelta, first: bool) -> dict[str, Any]:
    """The chunk of one delta (its choice, and on the first the prompt's ids)."""
    body = prepared.body
    sample = samples[delta.index]
    offset = len(sample.text)
    sample.token_ids += delta.token_ids
    sample.logprobs += delta.logprobs
    sample.text += delta.text
    record_id = None
    if delta.finish_reason is not None:
        sample.finish_reason = delta.finish_reason
        record_id = _finished(service, prepared, sample)
    choice = {"index": delta.index, "text": delta.text, "finish_reason": delta.finish_reason,
              "logprobs": _legacy_logprobs(service, delta.logprobs, offset) if body.logprobs is not None else None,
              **_tokens(prepared, delta.token_ids, delta.logprobs, record_id)}
    first_ids = {"prompt_token_ids": prepared.generation.prompt_ids} if first and body.return_token_ids else {}
    return {"choices": [choice], **first_ids}
