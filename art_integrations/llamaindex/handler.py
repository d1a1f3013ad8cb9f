"""LlamaIndex instrumentation that records LLM calls into the open `art_capture()`.

For agents that keep their own `OpenAILike` pointed at an art-backend:

    llm = OpenAILike(model=model.inference_name, api_base=".../v1", api_key="unused",
                     is_chat_model=True, is_function_calling_model=True,
                     additional_kwargs={"extra_body": {"return_token_ids": True}})  # art-backend's default, explicit
    instrument()                                     # once per process
    async with art_capture() as trajectory:
        await agent.run("...")

`return_token_ids` makes the backend keep each choice's exact tokens under the reply's message
id; the handler reads that id from `ChatResponse.raw` (the last chunk's, when streaming) and
the capture fetches the tokens on exit (under `gather_trajectory_groups`, once per group), with
the logprobs the trainer needs.

LlamaIndex's events carry messages and responses but not which LLM or agent made a call, so
`instrument()` also attaches a span handler that remembers, for each open span, the LLM that
opened it (its base URL and key) and the agent whose workflow step runs in it. Each call's
agent is read off its span's ancestors: the first agent of the outermost workflow run (an
`AgentWorkflow`'s root agent, or a lone `FunctionAgent`) is the main agent (""); every other
agent, such as one handed off to, is keyed by its name and becomes an additional history.

Handlers run inline in the caller's context, so `current_capture()` is the caller's even
across concurrent rollouts. Calls are paired start-to-end by span id in a registry shared by
all handlers, so installing the handler twice never records a call twice. A call it does not
record (an LLM that is not an `ARTLLM`, without `instrument()`) is noted in the capture, which
names it if it records nothing else (`art_capture()` installs the handler for that: `watch()`).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from llama_index.core.agent.workflow import AgentWorkflow, BaseWorkflowAgent
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.exception import ExceptionEvent
from llama_index.core.instrumentation.events.llm import (
    LLMChatEndEvent,
    LLMChatInProgressEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionInProgressEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.span import SimpleSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from llama_index.llms.openai.utils import to_openai_message_dict, to_openai_message_dicts

from art_integrations.capture.scope import CaptureScope, ModelCall, current_capture, record_call

logger = logging.getLogger(__name__)


# ----- what each open span tells ----------------------------------------------------------


@dataclass(frozen=True)
class _Facts:
    llm: bool = False  # the span is an LLM method
    llm_class: str = ""  # that LLM's class, to name it in a capture error
    endpoint: str | None = None  # that LLM's OpenAI base URL (…/v1)
    api_key: str | None = None
    art_llm: bool = False
    agent: str | None = None  # the agent whose workflow step runs in this span
    main_agent: str | None = None  # the main agent of a workflow run started in this span


def _facts(instance: Any, bound_args: inspect.BoundArguments) -> _Facts | None:
    if isinstance(instance, BaseLLM):
        return _Facts(llm=True, llm_class=type(instance).__name__, endpoint=getattr(instance, "api_base", None),
                      api_key=getattr(instance, "api_key", None), art_llm=getattr(type(instance), "is_art_policy", False))
    if isinstance(instance, AgentWorkflow):
        return _Facts(main_agent=instance.root_agent)
    if isinstance(instance, BaseWorkflowAgent):  # a lone agent's run
        return _Facts(agent=instance.name, main_agent=instance.name)
    for value in bound_args.arguments.values():  # a workflow step: its event names the agent
        name = getattr(value, "current_agent_name", None)
        if isinstance(name, str) and name:
            return _Facts(agent=name)
    return None


class ARTSpanHandler(BaseSpanHandler[SimpleSpan]):
    """Keeps each open span's parent and `_Facts`, so a call can be traced to its LLM and agent."""

    @classmethod
    def class_name(cls) -> str:
        return "ARTSpanHandler"

    def new_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                 parent_span_id: str | None = None, tags: dict[str, Any] | None = None,
                 **kwargs: Any) -> SimpleSpan | None:
        try:
            facts = _facts(instance, bound_args)
        except Exception:  # the dispatcher would drop this silently
            _report(f"reading span {id_} failed:\n{traceback.format_exc()}")
            facts = None
        return SimpleSpan(id_=id_, parent_id=parent_span_id, metadata={"art": facts} if facts else None)

    def prepare_to_exit_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             result: Any | None = None, **kwargs: Any) -> SimpleSpan | None:
        return self.open_spans.get(id_)  # returned spans are forgotten, not kept as completed

    def prepare_to_drop_span(self, id_: str, bound_args: inspect.BoundArguments, instance: Any | None = None,
                             err: BaseException | None = None, **kwargs: Any) -> SimpleSpan | None:
        _failed(id_, err)  # a non-streaming call that raised drops its span
        return self.open_spans.get(id_)

    def lineage(self, span_id: str | None) -> list[tuple[str, _Facts]]:
        """`span_id` and its open ancestors with their facts, innermost first."""
        chain: list[tuple[str, _Facts]] = []
        with self.lock:
            while span_id is not None and (span := self.open_spans.get(span_id)) is not None:
                chain.append((span_id, span.metadata["art"] if span.metadata else _NO_FACTS))
                span_id = span.parent_id
        return chain


_NO_FACTS = _Facts()
_spans = ARTSpanHandler()  # one for every handler: `instrument()` attaches it


def _agent_key(lineage: list[tuple[str, _Facts]]) -> str:
    agent = next((f.agent for _, f in lineage if f.agent), None)
    main = next((f.main_agent for _, f in reversed(lineage) if f.main_agent), None)
    return "" if agent is None or main is None or agent == main else agent


# ----- calls in flight, shared by every handler -------------------------------------------


@dataclass
class _Pending:
    scope: CaptureScope
    endpoint: str
    api_key: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    agent: str
    started: float
    record_id: str | None = None  # seen in a streamed chunk, in case the last chunk lacks it
    finish_reason: str | None = None


_pending: dict[str, _Pending] = {}
_pending_lock = threading.Lock()


def _failed(span_id: str | None, error: BaseException | None) -> None:
    with _pending_lock:
        pending = _pending.pop(span_id or "", None)
    if pending is not None:
        pending.scope.trajectory.logs.append(f"model call failed: {error!r}")


def _report(message: str, scope: CaptureScope | None = None) -> None:
    scope = scope or current_capture()
    if scope is not None:
        scope.error(message)
    else:
        logger.warning("art_capture: %s", message)


def _get(obj: Any, key: str) -> Any:
    # `raw` is an openai model (backend extras readable as attributes), a dict, or None
    return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)


def _first_choice(raw: Any) -> Any:
    choices = _get(raw, "choices") or []
    return choices[0] if choices else None


def _record_id(raw: Any) -> str | None:
    choice = _first_choice(raw)
    record_id = _get(_get(choice, "message") or _get(choice, "delta"), "id")
    return record_id if isinstance(record_id, str) and record_id.startswith("chatcmpl-") else None


def _finish_reason(raw: Any) -> str | None:
    return _get(_first_choice(raw), "finish_reason")


def _plain(value: Any) -> Any:
    """JSON-ready: LlamaIndex may leave openai objects (tool calls) inside a message dict."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----- the handler --------------------------------------------------------------------------


class ARTEventHandler(BaseEventHandler):
    """Records every LLM call made inside `art_capture()` (see the module docstring).

    `all_llms=False` records only `ARTLLM` calls (what an `ARTLLM` installs for itself, so a
    judge or helper model elsewhere in the app is not trained on); `instrument()` records every
    LLM, and reports the calls that came back without tokens. `base_url` / `api_key`: the
    backend's, for an LLM that does not expose `api_base` / `api_key`.
    """

    base_url: str | None = None
    api_key: str | None = None
    all_llms: bool = True

    @classmethod
    def class_name(cls) -> str:
        return "ARTEventHandler"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        try:
            if isinstance(event, (LLMChatStartEvent, LLMCompletionStartEvent)):
                self._start(event)
            elif isinstance(event, (LLMChatInProgressEvent, LLMCompletionInProgressEvent)):
                self._progress(event)
            elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)):
                self._end(event)
            elif isinstance(event, ExceptionEvent):  # a stream that raised mid-way
                _failed(event.span_id, event.exception)
        except Exception:  # the dispatcher drops handler errors silently: keep them visible
            _report(f"recording a LlamaIndex {event.class_name()} failed:\n{traceback.format_exc()}")

    def _start(self, event: LLMChatStartEvent | LLMCompletionStartEvent) -> None:
        scope = current_capture()
        if scope is None:
            logger.debug("Model call outside art_capture(): served, not recorded")
            return
        if event.span_id is None:
            scope.error("a LlamaIndex LLM call has no span, so its reply cannot be matched: it is not recorded")
            return
        if event.span_id in _pending:  # another handler has it
            return
        lineage = _spans.lineage(event.span_id)
        llm = next((f for _, f in lineage if f.llm), _NO_FACTS)
        if not (self.all_llms or llm.art_llm):
            scope.note_unrecorded(
                f"a LlamaIndex {llm.llm_class or 'LLM'} (not an ARTLLM, and no instrument())",
                "use ARTLLM, or call art_integrations.llamaindex.instrument() once to record every LLM, and pass "
                "additional_kwargs={'extra_body': {'return_token_ids': True}} to it")
            return
        if isinstance(event, LLMChatStartEvent):
            messages = _plain(to_openai_message_dicts(event.messages))
            tools = _plain(event.additional_kwargs.get("tools"))
        else:  # a chat model's complete(): the prompt goes as one user message
            messages, tools = [{"role": "user", "content": event.prompt}], None
        endpoint = self.base_url or llm.endpoint or ""
        pending = _Pending(scope=scope, endpoint=endpoint, api_key=self.api_key or llm.api_key, messages=messages,
                           tools=tools, agent=_agent_key(lineage), started=time.monotonic())
        with _pending_lock:
            if event.span_id in _pending:
                return
            # a wrapper LLM (StructuredLLM) reports the call its inner LLM reports again: keep the
            # innermost, the one that reached the backend
            for span_id, _ in lineage[1:]:
                _pending.pop(span_id, None)
            _pending[event.span_id] = pending

    def _progress(self, event: LLMChatInProgressEvent | LLMCompletionInProgressEvent) -> None:
        pending = _pending.get(event.span_id or "")
        if pending is not None:
            pending.record_id = _record_id(event.response.raw) or pending.record_id
            pending.finish_reason = _finish_reason(event.response.raw) or pending.finish_reason

    def _end(self, event: LLMChatEndEvent | LLMCompletionEndEvent) -> None:
        with _pending_lock:
            pending = _pending.pop(event.span_id or "", None)
        if pending is None:
            return
        if event.response is None:
            pending.scope.error("a streamed LlamaIndex call ended without a single chunk: nothing to record")
            return
        if not pending.endpoint:
            pending.scope.error("a LlamaIndex LLM call's base URL is unknown: install the handler with "
                                "art_integrations.llamaindex.instrument(), or pass ARTEventHandler(base_url=...)")
        raw = event.response.raw
        if isinstance(event, LLMChatEndEvent):
            response = _plain(to_openai_message_dict(event.response.message, drop_none=True))
        else:
            response = {"role": "assistant", "content": event.response.text}
        record_call(ModelCall(
            endpoint=pending.endpoint, record_id=_record_id(raw) or pending.record_id, messages=pending.messages,
            response=response, finish_reason=_finish_reason(raw) or pending.finish_reason, tools=pending.tools,
            agent=pending.agent, started=pending.started, api_key=pending.api_key), scope=pending.scope)


# ----- installing ---------------------------------------------------------------------------

_install_lock = threading.Lock()


def instrument(base_url: str | None = None, api_key: str | None = None, all_llms: bool = True) -> ARTEventHandler:
    """Attach the `ARTEventHandler` and its span handler to LlamaIndex's root dispatcher, once.

    Idempotent: a handler already attached is reused (and widened to every LLM when
    `all_llms`), so calling it again, or alongside `ARTLLM`, never records a call twice.
    """
    root = get_dispatcher()
    with _install_lock:
        handler = next((h for h in root.event_handlers if isinstance(h, ARTEventHandler)), None)
        if handler is None:
            handler = ARTEventHandler(base_url=base_url, api_key=api_key, all_llms=all_llms)
            root.add_event_handler(handler)
        else:
            handler.all_llms = handler.all_llms or all_llms
            handler.base_url = base_url or handler.base_url
            handler.api_key = api_key or handler.api_key
        if not any(h is _spans for h in root.span_handlers):
            root.add_span_handler(_spans)
    return handler


def watch() -> None:
    """Make sure a handler sees every LlamaIndex LLM call, so a capture learns of the calls it
    cannot record (an LLM that is not an `ARTLLM`, with no `instrument()` call). Installs the
    handler as `ARTLLM` does, recording only `ARTLLM`s; one already installed is kept as it is.
    `art_capture()` calls this."""
    instrument(all_llms=False)
