"""`ARTLLM`: the drop-in LlamaIndex LLM for a policy served by an art-backend.

It is llama-index's `OpenAILike` (so agents, tools, structured prediction, streaming, retries
and instrumentation behave exactly as users know them) with these differences: it is a chat
and function-calling model (`OpenAILike` defaults both to False, and agents would then
silently fall back to prompt completion without tools); its context window is the backend's;
each request asks the backend to keep the reply's exact tokens (`return_token_ids`); streams
end with the token usage (`stream_options.include_usage`, which `OpenAI` sends only when told);
and constructing one installs the `ARTEventHandler`, so its calls inside `art_capture()` are
recorded. Recording happens in that handler only, never here, so a call is recorded once
however many ways the handler was installed.
"""

from __future__ import annotations

from typing import Any, ClassVar

import httpx
from llama_index.llms.openai.utils import resolve_openai_credentials
from llama_index.llms.openai_like import OpenAILike

from art_integrations.backend import Backend
from art_integrations.llamaindex.handler import instrument
from art_integrations.model import TrainableModel


def fetch_context_window(api_base: str, model: str, api_key: str | None = None) -> int:
    """`max_model_len` of `model` from the backend's `GET /v1/models`."""
    url = f"{api_base.rstrip('/')}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key and api_key != "unused" else {}
    try:
        response = httpx.get(url, headers=headers, timeout=10)
        response.raise_for_status()
        entries = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        raise RuntimeError(f"Cannot read the context window from {url}: {error!r}. Start the backend "
                           "before building the LLM, or pass context_window=...") from error
    # every model a backend serves shares its engine's length; prefer the named one anyway
    lengths = [e.get("max_model_len") for e in entries if e.get("id") == model] or \
        [e.get("max_model_len") for e in entries]
    if not lengths or not isinstance(lengths[0], int):
        raise RuntimeError(f"{url} reports no max_model_len for {model!r}: is it an art-backend? "
                           "Pass context_window=... to use another OpenAI-compatible server.")
    return lengths[0]


class ARTLLM(OpenAILike):
    """`ARTLLM.from_model(model)`, `ARTLLM.from_backend(backend, model="name")`, or
    `ARTLLM(model="name", api_base=".../v1")`; any `OpenAILike` setting (max_tokens, top_p,
    additional_kwargs, max_retries, ...) works as usual and is sent as given.

    Three defaults differ from `OpenAILike`'s, on purpose: `temperature=1.0`, because a rollout
    should sample the policy being trained (LlamaIndex's 0.1 would make every rollout of a
    group alike and leave GRPO nothing to compare); `timeout=600`, because a local backend
    on CPU serving many concurrent rollouts answers slower than a hosted API; and the API key,
    read as `OpenAI` reads it (`api_key=`, else OPENAI_API_KEY), falls back to a placeholder,
    since a local backend needs none.
    """

    is_art_policy: ClassVar[bool] = True  # the handler (handler.py) records these calls as the policy's

    def __init__(self, model: str, api_base: str, api_key: str | None = None, context_window: int | None = None,
                 temperature: float = 1.0, timeout: float = 600.0, **kwargs: Any) -> None:
        kwargs.setdefault("is_chat_model", True)
        kwargs.setdefault("is_function_calling_model", True)
        # resolved here rather than by `OpenAI`, since the context window is read with it first
        api_key = resolve_openai_credentials(api_key=api_key)[0] or "unused"
        if context_window is None:
            context_window = fetch_context_window(api_base, model, api_key)
        super().__init__(model=model, api_base=api_base, api_key=api_key, context_window=context_window,
                         temperature=temperature, timeout=timeout, **kwargs)
        instrument(all_llms=False)  # keeps a handler the user installed as it is

    @classmethod
    def from_backend(cls, backend: Backend, model: str, **kwargs: Any) -> ARTLLM:
        return cls(model=model, api_base=f"{backend.base_url}/v1", api_key=backend.api_key or "unused", **kwargs)

    @classmethod
    def from_model(cls, model: TrainableModel, step: int | None = None, **kwargs: Any) -> ARTLLM:
        """The newest policy of a registered `TrainableModel` (or its checkpoint `step`)."""
        return cls.from_backend(model.backend, model.get_inference_name(step), **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "ARTLLM"

    def _get_model_kwargs(self, **kwargs: Any) -> dict[str, Any]:
        # OpenAI's version lets `additional_kwargs` replace a per-call `extra_body` wholesale;
        # merge them instead, so a call's own extra_body survives and tokens are always kept
        model_kwargs = super()._get_model_kwargs(**kwargs)
        model_kwargs["extra_body"] = {**(self.additional_kwargs.get("extra_body") or {}),
                                      **(kwargs.get("extra_body") or {}), "return_token_ids": True}
        if model_kwargs.get("stream"):
            model_kwargs.setdefault("stream_options", {"include_usage": True})
        return model_kwargs
