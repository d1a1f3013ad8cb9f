"""OpenAI chat-completions request and response shapes, plus vLLM's extensions.

Requests are validated here so a malformed body gets a 422 naming the field. A field of
OpenAI's or vLLM's request that would change the output and that this server does not
implement is refused by name (400), unless it carries the value that matches what the server
does; any other unknown field is accepted and named in a warning, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from art_backend.engine.base import LOWEST_LOGPROB

if TYPE_CHECKING:
    from art_backend.engine.base import TokenLogprob

# OpenAI's and vLLM's request fields that change the output and are not implemented here, each
# with the values that say to do what this server does anyway.
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None,), "audio": (None,), "modalities": (None, ["text"]),
    "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    "best_of": (None, 1), "use_beam_search": (None, False), "length_penalty": (None, 1.0), "min_tokens": (None, 0),
    "stop_token_ids": (None, []), "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,), "prompt_logprobs": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "echo": (None, False),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "add_special_tokens": (None, False), "documents": (None,), "chat_template": (None,),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "structural_tag": (None,), "structured_outputs": (None,),
    "logits_processors": (None,), "return_tokens_as_token_ids": (None, False), "vllm_xargs": (None,),
}
# OpenAI's request fields that do not change the output: accepted without a word
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                       "prediction"})


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # an earlier reply's reasoning, sent back as vLLM returned it (Qwen3's template renders it again)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDefinition(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str = "output"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a `json_schema` with a `schema`")
        return self


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to be refused or named (see NOT_IMPLEMENTED)

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> added logit
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's: a 64-bit integer
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM extensions
    top_k: int | None = Field(default=None, ge=-1)  # 0 or -1: no cut
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    # on unless turned off: ART's servers send token information unasked, and ART's rollout code
    # appends `response.choices[0]` expecting it to be trainable
    return_token_ids: bool = Field(default=True, description="Each choice's `token_ids` and `prompt_token_ids` "
                                   "(and the response's `prompt_token_ids`), kept for the callback handlers "
                                   "under the message id; false leaves them out (vLLM's default).")
    ignore_eos: bool = False
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="Extra names for the chat template, e.g. {\"enable_thinking\": false} for Qwen3; "
        "a name the template does not read is refused.")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        if "" in self.stop_strings:
            raise ValueError("stop holds an empty string, which would end every reply at once: leave it out")
        names = [tool.function.name for tool in self.tools or []]
        if any(not name for name in names) or len(set(names)) < len(names):
            raise ValueError(f"tools need distinct, non-empty function names; got {names}")
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            called |= {call.id for call in message.tool_calls or []}
            if message.role == "tool" and message.tool_call_id not in called:
                raise ValueError(f"messages[{index}] is a tool result for call {message.tool_call_id!r}, which no "
                                 "earlier assistant message made: give it the `id` of that call (`tool_call_id`)")
        for tool in self.tools or []:
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                raise ValueError(f"tool {tool.function.name!r}: `parameters` must be a JSON schema of type "
                                 f"object (the arguments are an object), got type {parameters.get('type')!r}")
        return self

    def not_implemented(self) -> list[str]:
        """The extra fields that would change the output in a way this server does not implement."""
        return sorted(name for name, value in (self.model_extra or {}).items()
                      if name in NOT_IMPLEMENTED and value not in NOT_IMPLEMENTED[name])

    def unknown(self) -> list[str]:
        """The extra fields this server knows nothing of."""
        return sorted(name for name in self.model_extra or {} if name not in NOT_IMPLEMENTED and name not in NO_EFFECT)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice


class TokenRecordsRequest(_Lenient):
    ids: list[str] = Field(max_length=4096)


def refuse_lone_surrogates(data: Any, where: str = "") -> Any:
    """`data` as it is, or a ValueError naming where a string holds half of a UTF-16 surrogate
    pair (JSON lets `"\\ud800"` through, but no UTF-8 text, prompt or file can hold it)."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'the body'} holds an unpaired UTF-16 surrogate: send whole characters "
                             "(pairs like \\ud83d\\ude00, or the UTF-8 text itself)") from None
    elif isinstance(data, dict):
        for key, value in data.items():
            refuse_lone_surrogates(key, f"a key in {where or 'the body'}")
            refuse_lone_surrogates(value, f"{where}.{key}" if where else str(key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            refuse_lone_surrogates(value, f"{where}.{index}" if where else str(index))
    return data


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def reportable(logprob: float) -> float:
    """A logprob JSON can carry: a token with no chance (-inf, among top logprobs past a top-k cut,
    say) is reported as LOWEST_LOGPROB, as OpenAI and vLLM do."""
    return max(logprob, LOWEST_LOGPROB)


def reportable_logprobs(entries: list[TokenLogprob]) -> list[float]:
    """Each sampled token's logprob, as JSON can carry it."""
    return [reportable(entry.logprob) for entry in entries]
