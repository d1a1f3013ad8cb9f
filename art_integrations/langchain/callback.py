"""A LangChain callback handler that records model calls into the open `art_capture()`.

For agents that keep their own `ChatOpenAI` pointed at an art-backend:

    llm = ChatOpenAI(base_url=".../v1", model=model.inference_name, api_key=...,
                     extra_body={"return_token_ids": True})      # art-backend's default, explicit
    with art_capture() as trajectory:
        agent.invoke(inputs, config={"callbacks": [ARTCallbackHandler()]})

The handler adds what only LangChain knows (which LangGraph agent and node a call ran in); the
call's exact tokens are the transport's (`capture/transports/`), which saw the same request go out
through the chat model's HTTP client and read them from its reply. The two are one call,
joined by the reply's message id (the backend's token record id), and kept once.

The handler runs inline (`run_inline = True`), in the caller's context, so the capture is the
caller's even under `ainvoke` and inside LangGraph's tasks. It keys its bookkeeping by
`run_id`, and tells sub-agents apart by LangGraph's `checkpoint_ns` (each subgraph is an agent).

A chat model run without this handler is noticed too (`watch()`): LangChain attaches a watcher
to every run that has no `ARTCallbackHandler`, and a capture that records nothing names the
models it saw that way.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import BaseMessage, convert_to_openai_messages
from langchain_core.outputs import LLMResult
from langchain_core.tracers.context import register_configure_hook

from art_integrations.capture.scope import CaptureScope, ModelCall, current_capture, record_call

logger = logging.getLogger(__name__)

_LANGGRAPH_KEYS = ("langgraph_node", "langgraph_step", "langgraph_checkpoint_ns", "checkpoint_ns")


def agent_of(metadata: dict[str, Any]) -> str:
    """The subgraph path of a call: "" for the root graph, "researcher" for a call made inside
    the `researcher` subgraph node (namespace "researcher:<task>|agent:<task>")."""
    namespace = str(metadata.get("langgraph_checkpoint_ns") or metadata.get("checkpoint_ns") or "")
    names = [part.split(":", 1)[0] for part in namespace.split("|") if part]
    return "|".join(names[:-1])


@dataclass
class _Pending:
    scope: CaptureScope
    endpoint: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    metadata: dict[str, Any]
    started: float = field(default_factory=time.monotonic)


class ARTCallbackHandler(BaseCallbackHandler):
    """Records every chat-model call made inside `art_capture()` (see the module docstring)."""

    run_inline = True
    raise_error = True  # a recording failure is the user's to see, not LangChain's to log and drop

    def __init__(self, base_url: str | None = None, api_key: str | None = None) -> None:
        """`base_url`: the backend's OpenAI URL if the chat model does not expose it
        (ChatOpenAI does); `api_key`: the backend's key, if it requires one."""
        super().__init__()
        self.base_url = base_url
        self.api_key = api_key
        self._pending: dict[UUID, _Pending] = {}
        self._lock = threading.Lock()

    def _endpoint(self, serialized: dict[str, Any] | None, params: dict[str, Any]) -> str:
        kwargs = (serialized or {}).get("kwargs") or {}
        return str(self.base_url or kwargs.get("openai_api_base") or kwargs.get("base_url")
                   or params.get("base_url") or "")

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]], *,
                            run_id: UUID, parent_run_id: UUID | None = None, tags: list[str] | None = None,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        scope = current_capture()
        if scope is None:
            logger.debug("Model call outside art_capture(): served, not recorded")
            return
        params = kwargs.get("invocation_params") or {}
        metadata = metadata or {}
        pending = _Pending(
            scope=scope,
            endpoint=self._endpoint(serialized, params),
            messages=convert_to_openai_messages(messages[0]),
            tools=params.get("tools"),
            metadata={k: metadata[k] for k in _LANGGRAPH_KEYS if k in metadata},
        )
        with self._lock:
            self._pending[run_id] = pending

    def on_llm_end(self, response: LLMResult, *, run_id: UUID, parent_run_id: UUID | None = None,
                   **kwargs: Any) -> None:
        with self._lock:
            pending = self._pending.pop(run_id, None)
        if pending is None:
            return
        if not pending.endpoint:
            pending.scope.error("a model call's base URL is unknown: pass ARTCallbackHandler(base_url=...)")
        for generations in response.generations:
            for generation in generations:
                message = getattr(generation, "message", None)
                if message is None:
                    pending.scope.error("a completion-style LLM call cannot be recorded; use a chat model")
                    continue
                record_id = message.id if message.id and message.id.startswith("chatcmpl-") else None
                info = generation.generation_info or {}
                reply = convert_to_openai_messages(message)
                record_call(ModelCall(
                    endpoint=pending.endpoint, record_id=record_id, messages=pending.messages, response=reply,
                    finish_reason=info.get("finish_reason"), tools=pending.tools,
                    agent=agent_of(pending.metadata), metadata=pending.metadata, started=pending.started,
                    api_key=self.api_key), scope=pending.scope)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, parent_run_id: UUID | None = None,
                     **kwargs: Any) -> None:
        with self._lock:
            pending = self._pending.pop(run_id, None)
        if pending is not None:
            pending.scope.trajectory.logs.append(f"model call failed: {error!r}")


# ----- noticing chat models that run without the handler --------------------------------------


class _UnrecordedCalls(BaseCallbackHandler):
    """What LangChain attaches to a run that has no `ARTCallbackHandler` (see `watch()`): each
    chat model call it sees inside a capture is one the capture cannot record."""

    run_inline = True  # in the caller's context, where its capture is

    def on_chat_model_start(self, serialized: dict[str, Any] | None, messages: list[list[BaseMessage]],
                            **kwargs: Any) -> None:
        scope = current_capture()
        if scope is not None:
            name = ((serialized or {}).get("id") or ["chat model"])[-1]  # LangChain's path: [..., "ChatOpenAI"]
            scope.note_unrecorded(
                f"a LangChain {name} with no ARTCallbackHandler",
                "use ChatART, or pass config={'callbacks': [ARTCallbackHandler()]} to the agent and "
                "extra_body={'return_token_ids': True} to the chat model")


# Never unset: LangChain reads the hook's handler from this variable in every context
_unrecorded_calls: ContextVar[_UnrecordedCalls] = ContextVar("art_unrecorded_calls", default=_UnrecordedCalls())


@functools.cache  # once per process: LangChain keeps its hooks for good
def watch() -> None:
    """Have LangChain attach `_UnrecordedCalls` to every run whose callbacks hold no
    `ARTCallbackHandler` (`ChatART` brings its own), so a capture learns of the chat models that
    ran in it unrecorded. Outside captures the watcher does nothing. `art_capture()` calls this."""
    register_configure_hook(_unrecorded_calls, inheritable=False, handle_class=ARTCallbackHandler)
