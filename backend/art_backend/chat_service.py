"""The chat completion service: the one path from an OpenAI chat request to the engine and back,
whole or streamed.

It stands apart from the HTTP app (`server.py`) because more than the chat route drives it: the
Responses API (`responses.py`) is served through it, text completions (`completions.py`) share its
sampling settings, token texts and records, and SFT renders demonstrations with its formatter, so
that training sees exactly the prompts serving builds. With `return_token_ids` (as vLLM; on unless
turned off) responses carry `prompt_token_ids` and each choice's `token_ids`, so clients can train
on exactly the tokens the policy saw and produced; a prompt that replays an earlier turn keeps that
turn's exact ids (`continuation.py`), so multi-turn rollouts stay one sequence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from art_backend.chat_format import Prompt, ReplyStream
from art_backend.continuation import DEFAULT_BUDGET_BYTES, TokenContinuations
from art_backend.engine.base import Engine, GenerationRequest, SamplingParams, SequenceDelta, TokenLogprob
from art_backend.errors import ContextLengthError, ModelNotServedError, UnsupportedFeatureError, error_body
from art_backend.grammar import json_grammar
from art_backend.protocol import ChatCompletionRequest, completion_id, now, reportable, reportable_logprobs
from art_backend.token_records import TokenRecords
from art_backend.tool_formats import ParsedOutput

logger = logging.getLogger(__name__)


@dataclass
class _Prepared:
    body: ChatCompletionRequest
    generation: GenerationRequest
    prompt: Prompt
    tools: list[dict[str, Any]] | None  # the tools whose calls the reply is read for (None: not read for calls)
    token_logprobs: bool = False  # each token's logprob beside its id (TOKEN_LOGPROBS_HEADER)

    def reply_stream(self, service: ChatService) -> ReplyStream | None:
        """What reads this request's streamed reply, where it has markup to read (calls, reasoning)."""
        if self.tools is not None or service.formatter.reasoning is not None:
            return ReplyStream(service.formatter, self.prompt, self.tools)
        return None


@dataclass
class GeneratedChoice:
    """One choice as the engine's deltas build it (chat and text completions alike)."""
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class ChatService:
    """Turns chat requests into engine requests and engine output into OpenAI responses."""

    def __init__(self, engine: Engine, token_records_bytes: int = 256 << 20,
                 continuations_bytes: int = DEFAULT_BUDGET_BYTES, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.formatter = engine.chat_formatter(tool_call_parser, reasoning_parser)
        self.records = TokenRecords(token_records_bytes)
        self.continuations = TokenContinuations(engine.tokenizer, continuations_bytes)
        self._token_text = lru_cache(maxsize=65536)(self._decode_one)
        # no token is longer than this many characters, so longer texts can be refused untokenized
        self._longest_token = max(map(len, engine.tokenizer.get_vocab()))

    def _decode_one(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def prepare(self, body: ChatCompletionRequest, token_logprobs: bool = False) -> _Prepared:
        if body.model not in self.engine.served_models():  # before streaming starts, so it can be a 404
            raise ModelNotServedError.unknown(body.model, self.engine.served_models())
        refused = body.not_implemented()
        if refused:
            raise UnsupportedFeatureError(f"Not supported by this server: {', '.join(refused)}. Leave them out "
                                          "(or at their defaults); they would change the output.")
        if body.unknown():
            logger.warning("Ignoring request fields this server does not know: %s", ", ".join(body.unknown()))
        vocabulary = len(self.engine.tokenizer)
        beyond = sorted(token for token in body.logit_bias or {} if not 0 <= token < vocabulary)
        if beyond:
            raise UnsupportedFeatureError(f"logit_bias names token ids outside the vocabulary (0..{vocabulary - 1}): "
                                          f"{', '.join(map(str, beyond))}.")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        tool_choice = body.tool_choice_value()
        prompt = self.formatter.render_prompt(messages, tools, tool_choice, body.chat_template_kwargs)
        text = prompt.text
        if len(text) > self.engine.max_model_len * self._longest_token:
            raise ContextLengthError.text_over(self.engine.max_model_len, len(text))
        # A prompt that replays an earlier turn keeps that turn's exact ids (see continuation.py);
        # the tool calls it carries back tell which turn, where several wrote the same text.
        call_ids = {call["id"] for m in messages for call in m.get("tool_calls") or ()}
        prompt_ids = self.continuations.tokenize(text, call_ids)
        grammar = self._grammar(body, tools, tool_choice, prompt)
        parse_tools = bool(tools) and body.tool_choice != "none"
        used = len(prompt_ids)
        room = self.engine.max_model_len - used
        limit = body.completion_limit
        if room <= 0 or (limit is not None and limit > room):
            raise ContextLengthError.over(self.engine.max_model_len, used, limit or 0)
        params = self.sampling_params(
            body, limit or room,
            # the token records of `return_token_ids` keep logprobs too (the trainer's importance ratio)
            logprobs=bool(body.logprobs or body.return_token_ids),
            top_logprobs=body.top_logprobs or 0,
            grammar=grammar,
            # a family whose call markup opens with a special token needs it in the text (as vLLM does)
            skip_special_tokens=not (parse_tools and self.formatter.tool_format.keeps_special_tokens),
        )
        served = None if body.model == self.engine.base_model_name else body.model
        generation = GenerationRequest(prompt_ids, params, body.n, served)
        return _Prepared(body, generation, prompt, tools if parse_tools else None, token_logprobs)

    @staticmethod
    def sampling_params(body: Any, max_tokens: int, **settings: Any) -> SamplingParams:
        """What a chat or text completion request (the same field names) asks of the sampler;
        `settings`: the rest of `SamplingParams`, which differ between the two."""
        return SamplingParams(
            max_tokens=max_tokens,
            # below 1e-5 is greedy, as in vLLM: dividing float32 logits by less overflows
            temperature=1.0 if body.temperature is None else body.temperature if body.temperature >= 1e-5 else 0.0,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),
            min_p=body.min_p or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias or {},
            seed=body.seed,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            **settings,
        )

    def _grammar(self, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                 tool_choice: str | dict[str, Any] | None, prompt: Prompt) -> str | None:
        """A required or named tool call, or `response_format` JSON, is enforced by a grammar."""
        required = self.formatter.required_tools(tools, tool_choice)
        if required is not None:
            if body.response_format is not None and body.response_format.type != "text":
                raise UnsupportedFeatureError("Ask for either a required tool call or response_format JSON, not both.")
            return self.formatter.call_grammar(
                required, parallel=body.parallel_tool_calls is not False and len(required) > 1, prompt=prompt)
        if body.response_format is not None:
            return json_grammar(body.response_format.model_dump(by_alias=True))
        return None

    def _finished(self, prompt_ids: list[int], choice: GeneratedChoice, tool_calls: list[dict[str, Any]]) -> None:
        """A complete choice (not an aborted one) can be continued by the next turn's prompt, which
        carries back the ids of the tool calls it made."""
        if choice.finish_reason in ("stop", "length"):
            self.continuations.remember(prompt_ids, choice.token_ids, [call["id"] for call in tool_calls])

    # ----- response pieces --------------------------------------------------------------

    def _logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": reportable(logprob), "bytes": list(text.encode())}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}

    @staticmethod
    def _tool_calls(parsed: ParsedOutput) -> list[dict[str, Any]]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in parsed.tool_calls]

    @staticmethod
    def _finish_reason(reason: str | None, parsed: ParsedOutput | None) -> str | None:
        if parsed is not None and parsed.tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    # ----- non-streaming ----------------------------------------------------------------

    async def complete(self, prepared: _Prepared) -> dict[str, Any]:
        body, generation = prepared.body, prepared.generation
        choices = [GeneratedChoice(i) for i in range(generation.n)]
        async for delta in self.engine.generate(generation):
            choice = choices[delta.index]
            choice.token_ids += delta.token_ids
            choice.logprobs += delta.logprobs
            choice.text += delta.text
            choice.finish_reason = delta.finish_reason or choice.finish_reason
        out_choices = []
        response_id = completion_id()
        for choice in choices:
            parsed = self.formatter.parse(choice.text, prepared.prompt, prepared.tools)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            entry: dict[str, Any] = {"index": choice.index, "message": message}
            if parsed.reasoning is not None:
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning
            if parsed.tool_calls:
                message["tool_calls"] = self._tool_calls(parsed)
            self._finished(generation.prompt_ids, choice, message.get("tool_calls", []))
            if parsed.parse_error:
                entry["tool_call_parse_error"] = parsed.parse_error
            entry["logprobs"] = self._logprobs(choice.logprobs) if body.logprobs else None
            entry["finish_reason"] = self._finish_reason(choice.finish_reason, parsed)
            if body.return_token_ids:
                entry["token_ids"] = choice.token_ids
                entry["prompt_token_ids"] = generation.prompt_ids  # a choice appended on its own keeps its prompt
                message["id"] = f"{response_id}-{choice.index}"
                if prepared.token_logprobs:
                    entry["token_logprobs"] = reportable_logprobs(choice.logprobs)
                self.records.add(message["id"], body.model, generation.prompt_ids, choice.token_ids, choice.logprobs)
            out_choices.append(entry)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        prompt_tokens = len(generation.prompt_ids)
        response: dict[str, Any] = {
            "id": response_id, "object": "chat.completion", "created": now(), "model": body.model,
            "choices": out_choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = generation.prompt_ids
        return response

    # ----- streaming --------------------------------------------------------------------

    async def stream(self, prepared: _Prepared) -> AsyncIterator[str]:
        body, generation = prepared.body, prepared.generation
        base = {"id": completion_id(), "object": "chat.completion.chunk", "created": now(), "model": body.model}

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n"

        first: dict[str, Any] = {"prompt_token_ids": generation.prompt_ids} if body.return_token_ids else {}
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for i in range(generation.n)], **first)
        filters = [prepared.reply_stream(self) for _ in range(generation.n)]
        choices = [GeneratedChoice(i) for i in range(generation.n)]
        completion_tokens = 0
        try:
            async for delta in self.engine.generate(generation):
                completion_tokens += len(delta.token_ids)
                choice_id = f"{base['id']}-{delta.index}" if body.return_token_ids else None
                yield chunk([self._stream_choice(prepared, delta, filters[delta.index], choice_id)])
                choice = choices[delta.index]
                choice.token_ids += delta.token_ids
                choice.logprobs += delta.logprobs
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    finish = self._stream_finish(delta, filters[delta.index], choice_id)
                    self._finished(generation.prompt_ids, choice, finish["delta"].get("tool_calls", []))
                    if choice_id is not None:
                        self.records.add(choice_id, body.model, generation.prompt_ids, choice.token_ids,
                                         choice.logprobs)
                    yield chunk([finish])
        except Exception as error:  # headers are sent: report in-band, as vLLM does
            logger.exception("Generation failed mid-stream")
            yield f"data: {json.dumps(error_body(str(error), 'InternalServerError', code=500))}\n\n"
            return
        if body.stream_options is not None and body.stream_options.include_usage:
            prompt_tokens = len(generation.prompt_ids)
            yield chunk([], usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                   "total_tokens": prompt_tokens + completion_tokens})
        yield "data: [DONE]\n\n"

    def _stream_choice(self, prepared: _Prepared, delta: SequenceDelta,
                       stream_filter: ReplyStream | None, choice_id: str | None) -> dict[str, Any]:
        body = prepared.body
        reasoning, content = stream_filter.feed(delta.text) if stream_filter else ("", delta.text)
        message: dict[str, Any] = {"content": content} if content else {}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if choice_id is not None:
            message["id"] = choice_id
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs) if body.logprobs else None,
            "finish_reason": None,
        }
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            if prepared.token_logprobs:
                choice["token_logprobs"] = reportable_logprobs(delta.logprobs)
        return choice

    def _stream_finish(self, delta: SequenceDelta, stream_filter: ReplyStream | None,
                       choice_id: str | None) -> dict[str, Any]:
        parsed = stream_filter.finish() if stream_filter else None
        message: dict[str, Any] = {"id": choice_id} if choice_id is not None else {}
        choice: dict[str, Any] = {"index": delta.index, "delta": message, "logprobs": None}
        if parsed is not None:
            if parsed.reasoning:
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning
            if parsed.content:
                message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [{"index": k, **call} for k, call in enumerate(self._tool_calls(parsed))]
            if parsed.parse_error:
                choice["tool_call_parse_error"] = parsed.parse_error
        choice["finish_reason"] = self._finish_reason(delta.finish_reason, parsed)
        return choice
