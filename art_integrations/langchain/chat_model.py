"""`ChatART`: the drop-in LangChain chat model for a policy served by an art-backend.

It is langchain-openai's `ChatOpenAI` (so tools, structured output, streaming, retries,
batching and every callback behave exactly as users know them) with three things added: each
request asks for the reply's exact tokens and logprobs (`return_token_ids`, `logprobs`), the
tokens travel in each generation's `generation_info` (ChatOpenAI drops response fields it does
not know), and an `ARTCallbackHandler` is attached so calls inside `art_capture()` are
recorded. With the tokens in hand a capture needs no request of its own on exit.

Two defaults differ from ChatOpenAI's: the API key (`api_key=`, `openai_api_key=` or
OPENAI_API_KEY, as ChatOpenAI reads it) falls back to a placeholder, since a local backend needs
none; and streams report token usage (`stream_usage`), which ChatOpenAI asks for only at
OpenAI's own URL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.utils import secret_from_env
from langchain_openai import ChatOpenAI
from pydantic import Field, SecretStr

from art_integrations.backend import Backend
from art_integrations.langchain.callback import ARTCallbackHandler
from art_integrations.model import TrainableModel
from art_integrations.openai_capture import RECORDED_BY_HEADER


class ChatART(ChatOpenAI):
    """`ChatART.from_model(model)`, `ChatART.from_backend(backend, model="name")`, or
    `ChatART(base_url=".../v1", model="name")`; any `ChatOpenAI` setting (temperature,
    max_tokens, top_p, stop, seed, ...) works as usual and is sent as given."""

    # ChatOpenAI's field with a placeholder where it has no key: the OpenAI client refuses to
    # start without one, and a local backend checks none
    openai_api_key: SecretStr | None | Callable[[], str] | Callable[[], Awaitable[str]] = Field(
        alias="api_key", default_factory=secret_from_env("OPENAI_API_KEY", default="unused"))
    stream_usage: bool | None = True  # the backend sends the usage chunk that `stream_options` asks for

    def __init__(self, **kwargs: Any) -> None:
        kwargs["extra_body"] = {**(kwargs.get("extra_body") or {}), "return_token_ids": True}
        kwargs.setdefault("logprobs", True)  # the sampling policy's logprobs, which training needs
        # recorded here, with its tokens: the openai SDK's transport capture leaves these requests alone
        kwargs["default_headers"] = {**(kwargs.get("default_headers") or {}), RECORDED_BY_HEADER: "ChatART"}
        super().__init__(**kwargs)
        key = self.openai_api_key  # a callable key is the OpenAI client's to call, per request
        api_key = key.get_secret_value() if isinstance(key, SecretStr) else None
        handler = ARTCallbackHandler(base_url=self.openai_api_base, api_key=None if api_key == "unused" else api_key)
        if isinstance(self.callbacks, BaseCallbackManager):
            self.callbacks.add_handler(handler, inherit=False)
        else:
            self.callbacks = [*(self.callbacks or []), handler]

    @classmethod
    def from_backend(cls, backend: Backend, model: str, **kwargs: Any) -> ChatART:
        return cls(model=model, base_url=f"{backend.base_url}/v1", api_key=backend.api_key or "unused", **kwargs)

    @classmethod
    def from_model(cls, model: TrainableModel, step: int | None = None, **kwargs: Any) -> ChatART:
        """The newest policy of a registered `TrainableModel` (or its checkpoint `step`)."""
        return cls.from_backend(model.backend, model.get_inference_name(step), **kwargs)

    @property
    def _llm_type(self) -> str:
        return "art-chat"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        # load() revives only the classes in langchain-core's allowlist (langchain_core.load.mapping),
        # so a dump of ChatART could never be loaded: unserializable, as other integrations outside it
        return False

    def _create_chat_result(self, response: Any, generation_info: dict[str, Any] | None = None) -> ChatResult:
        result = super()._create_chat_result(response, generation_info)
        body = response if isinstance(response, dict) else response.model_dump()
        for generation, choice in zip(result.generations, body.get("choices") or []):
            if choice.get("token_ids") is not None and body.get("prompt_token_ids") is not None:
                generation.generation_info = {**(generation.generation_info or {}),
                                              "prompt_token_ids": body["prompt_token_ids"],
                                              "token_ids": choice["token_ids"]}
        return result

    def _convert_chunk_to_generation_chunk(self, chunk: dict[str, Any], default_chunk_class: type,
                                           base_generation_info: dict[str, Any] | None) -> ChatGenerationChunk | None:
        # Streamed ids arrive as deltas; LangChain concatenates list fields when it merges chunks.
        generation = super()._convert_chunk_to_generation_chunk(chunk, default_chunk_class, base_generation_info)
        choices = chunk.get("choices") or []
        ids = {key: value for key, value in (("prompt_token_ids", chunk.get("prompt_token_ids")),
                                             ("token_ids", choices[0].get("token_ids") if choices else None))
               if value is not None}
        if generation is not None and ids:
            generation.generation_info = {**(generation.generation_info or {}), **ids}
        return generation

    def with_structured_output(  # type: ignore[override]
        self,
        schema: Any = None,
        *,
        method: Literal["function_calling", "json_mode", "json_schema"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """As ChatOpenAI's, defaulting to function calling: the backend forces the tool call,
        so even a small model answers in the schema's shape."""
        return super().with_structured_output(schema, method=method, include_raw=include_raw, strict=strict, **kwargs)
