"""`ChatART`: the drop-in LangChain chat model for a policy served by an art-backend.

It is langchain-openai's `ChatOpenAI` (so tools, structured output, streaming, retries,
batching and every callback behave exactly as users know them) with two things added: each
request asks for the reply's exact tokens and logprobs (`return_token_ids`, `logprobs`), and an
`ARTCallbackHandler` is attached, so that a call inside `art_capture()` is recorded with the
LangGraph agent and node it ran in. Its tokens are the transport's (`capture/transports/`), which reads
them from the reply as it does for any client: one path for every call's tokens.

Two defaults differ from ChatOpenAI's: the API key (`api_key=`, `openai_api_key=` or
OPENAI_API_KEY, as ChatOpenAI reads it) falls back to a placeholder, since a local backend needs
none; and streams report token usage (`stream_usage`), which ChatOpenAI asks for only at
OpenAI's own URL.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from langchain_core.callbacks import BaseCallbackManager
from langchain_core.utils import secret_from_env
from langchain_openai import ChatOpenAI
from pydantic import Field, SecretStr

from art_integrations.backend import Backend
from art_integrations.langchain.callback import ARTCallbackHandler
from art_integrations.model import TrainableModel


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
