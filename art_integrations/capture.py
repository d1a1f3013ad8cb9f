"""`art_capture()`: every model call made inside lands in one trajectory, with exact tokens.

A call's exact tokens take one path: the HTTP transport (`transports/`) sees every generation
request an HTTP client sends inside the capture and reads the tokens from the backend's reply.
Integrations (the LangChain callback handler, the LlamaIndex handler, the drop-in models) add
structure only: each finished call they `record_call()` names the agent and node it ran in, and
is joined to the transport's copy of it by record id (`_once`). A call goes to the innermost
capture open in the caller's context (a `ContextVar`, so concurrent asyncio tasks and
LangChain's executor threads each see their own). On exit the calls become the trajectory's
conversations; the logprobs of replies that did not bring them (the first call to a backend no
client named) are then fetched from the backend in one request, or under
`gather_trajectory_groups` once per group:

- calls are grouped by agent (LangGraph's checkpoint namespace: the root graph is the main
  agent, each subgraph a sub-agent);
- within an agent, a call continues a conversation when its messages extend that
  conversation's last call and reply, else it starts a branch;
- the main agent's first conversation is the trajectory's own; every other one becomes an
  additional history.

No call is lost silently: a call that finishes after its capture exited, and a capture that
recorded no call (naming the model calls an integration saw but could not record, when there
were any), are each warned and counted in `metrics["capture_errors"]`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import Any

import httpx

from art_integrations.trajectory import Choice, History, Trajectory

logger = logging.getLogger(__name__)


@dataclass
class ModelCall:
    """One model call as an integration saw it; `choice` gets its exact tokens on capture exit."""

    endpoint: str  # the OpenAI base URL the call went to (…/v1)
    record_id: str | None  # the choice's id on the backend (its message id), None if not returned
    messages: list[dict[str, Any]]
    response: dict[str, Any]  # the assistant message, OpenAI-shaped
    finish_reason: str | None = None
    tools: list[dict[str, Any]] | None = None
    agent: str = ""  # "" = the main agent
    metadata: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    api_key: str | None = None
    choice: Choice | None = None  # its exact tokens: read from the reply by the transport, or fetched at exit
    via_transport: bool = False  # seen where an HTTP client sent it (transports/)
    teacher: bool = False  # another server's reply (art_capture(teacher=True)): a message, no tokens
    tokenless: bool = False  # its tokens cannot be had (the capture's errors say why): a message only

    @property
    def waits_for_tokens(self) -> bool:
        """No exact tokens yet, and some to come (a teacher's reply has none)."""
        return self.choice is None and not self.teacher and not self.tokenless


LATE_CALL = ("a model call finished after its art_capture() had exited (a task started inside the capture and "
             "awaited outside it?), so it is not in the trajectory: await every task the rollout starts before "
             "leaving the `with art_capture()` block")
NO_CALLS = ("art_capture() recorded no model call, so the trajectory is empty. Likely causes: the model was not "
            "called at an art-backend through an HTTP client the capture sees (httpx, httpx2, requests, aiohttp: "
            "the openai SDK and any framework or hand-written agent on them is recorded with its base URL pointed "
            "at the backend's /v1, as a POST to chat/completions, responses or completions); a client it cannot "
            "see (a websocket, gRPC, another HTTP library, another path; DSPy's default engine, which opens its own "
            "sockets: give dspy.LM engine=\"litellm\") needs an integration: ChatART, ARTLLM, "
            "config={'callbacks': [ARTCallbackHandler()]} for your own ChatOpenAI, "
            "art_integrations.llamaindex.instrument() for your own LlamaIndex LLM, or trajectory.add_response() "
            "with the backend's reply; they ran inside no_capture(); the calls ran in a task still running when "
            "the capture exited (await it inside the capture); or they ran in a thread that does not carry the "
            "capture's context (use asyncio.to_thread, not run_in_executor or a bare Thread)")


class CaptureScope:
    def __init__(self, trajectory: Trajectory, teacher: bool = False) -> None:
        self.trajectory = trajectory
        self.teacher = teacher  # replies of servers that are not backends are recorded too, as messages
        self.calls: list[ModelCall] = []
        self.placeholders: list[tuple[list[Any], int, ModelCall]] = []  # replies waiting for their tokens
        # (model, fix) -> how many calls an integration saw in this capture but could not record
        self.unrecorded: Counter[tuple[str, str]] = Counter()
        self._closed = False  # the capture exited: its calls are assembled, a call arriving now is late
        self._late: set[str | None] = set()  # the record ids of late calls
        self._lock = threading.Lock()  # calls may arrive from executor threads

    def add(self, call: ModelCall) -> bool:
        """Keep `call`; False (and a capture error) when the capture has already exited."""
        with self._lock:
            if not self._closed:
                self.calls.append(call)
                return True
            reported = call.record_id is not None and call.record_id in self._late
            self._late.add(call.record_id)
        if not reported:  # a late call that an integration and the transport both saw is one late call
            self.error(LATE_CALL)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def note_unrecorded(self, model: str, fix: str) -> None:
        """An integration saw a call to `model` here that it cannot record (no handler for it).
        A judge or helper model beside the policy is normal; it becomes a capture error only if
        the capture records nothing else (see `report_if_empty`)."""
        logger.debug("A call to %s inside art_capture(): served, not recorded", model)
        with self._lock:
            self.unrecorded[(model, fix)] += 1

    def report_if_empty(self) -> None:
        """A capture that recorded no call has nothing to train on, and is almost always a setup
        mistake: say which, naming the models seen without a handler when an integration saw any."""
        if self.calls or any(history.choices() for history in self.trajectory.histories()):
            return
        with self._lock:  # a late note may still arrive from another thread
            unrecorded = list(self.unrecorded.items())
        for (model, fix), count in unrecorded:
            self.error(f"art_capture() recorded no model call, but {count} call{'s' * (count > 1)} to {model} "
                       f"ran inside it unrecorded: {fix}")
        if not unrecorded:
            self.error(NO_CALLS)

    def error(self, message: str) -> None:
        """A recording problem: kept in the trajectory's logs and counted, never dropped."""
        logger.warning("art_capture: %s", message)
        with self._lock:
            self.trajectory.logs.append(f"capture error: {message}")
            errors = self.trajectory.metrics.get("capture_errors", 0)
            self.trajectory.metrics["capture_errors"] = int(errors) + 1


_current: ContextVar[CaptureScope | None] = ContextVar("art_capture", default=None)


def current_capture() -> CaptureScope | None:
    return _current.get()


def current_trajectory(*, require: bool = False) -> Trajectory | None:
    """ART's `current_trajectory()`: the trajectory the innermost open capture records into
    (None outside one; with `require=True`, a RuntimeError)."""
    scope = _current.get()
    if scope is None and require:
        raise RuntimeError("No trajectory is being captured here: call this inside `async with art_capture()` "
                           "(or a rollout run by art.trajectory(...))")
    return scope.trajectory if scope is not None else None


@contextmanager
def no_capture() -> Iterator[None]:
    """ART's `no_capture()`: model calls inside are not recorded into the enclosing capture (a
    judge or helper model on the same backend); a capture opened inside records its own."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


async def trajectory(coroutine: Coroutine[Any, Any, object]) -> Trajectory:
    """ART's `art.trajectory(rollout(...))`: runs the coroutine inside `art_capture()` and returns
    the trajectory its model calls made (its own return value is not used)."""
    if not isinstance(coroutine, Coroutine):
        raise TypeError(f"art.trajectory() takes a coroutine not yet started, as `rollout(scenario)` gives, not "
                        f"{type(coroutine).__name__}")
    async with art_capture() as captured:
        await coroutine
    return captured


def record_call(call: ModelCall, scope: CaptureScope | None = None) -> bool:
    """Add `call` to `scope` (default: the capture open here). False when there is none, or it
    has exited (a late call: counted as a capture error)."""
    scope = scope or _current.get()
    if scope is None:
        logger.debug("Model call outside art_capture(): served, not recorded")
        return False
    return scope.add(call)


# Where each agent framework's integration can notice the calls no handler of ours sees, keyed
# by the framework's module: a capture sets one up only for a framework the process has loaded.
_WATCHES = {"langchain_core": "art_integrations.langchain.callback",
            "llama_index.core": "art_integrations.llamaindex.handler"}
_unwatchable: set[str] = set()  # loaded without our extra's packages: nothing to set up


def _watch_frameworks() -> None:
    """Let each loaded framework's integration note unrecorded calls into the open capture, so
    that a user who kept a plain ChatOpenAI or OpenAILike and never imported our integration
    still learns which model went unrecorded. Cheap after the first capture (each `watch()`
    is idempotent)."""
    for framework, module in _WATCHES.items():
        if framework in sys.modules and framework not in _unwatchable:
            try:
                importlib.import_module(module).watch()
            except ImportError as error:
                _unwatchable.add(framework)
                logger.debug("Cannot watch %s for unrecorded calls (%r): a capture that records nothing says "
                             "only the likely causes", framework, error)


def _install_transport() -> None:
    """Capture every loaded HTTP client's generation requests at its transport (see
    transports/; imported here, since it records into this module's scopes)."""
    from art_integrations.transports import install

    install()


# ----- fetching tokens ---------------------------------------------------------------------


def _requests(calls: list[ModelCall]) -> dict[tuple[str, str | None], list[ModelCall]]:
    by_endpoint: dict[tuple[str, str | None], list[ModelCall]] = {}
    for call in calls:
        if call.waits_for_tokens and call.record_id is not None:
            by_endpoint.setdefault((call.endpoint.rstrip("/"), call.api_key), []).append(call)
    return by_endpoint


def exact_choice(call: ModelCall, prompt_token_ids: list[int], token_ids: list[int], logprobs: list[float]) -> Choice:
    """`call`'s reply with the exact tokens the backend generated it from."""
    return Choice(message=call.response, finish_reason=call.finish_reason,
                  logprobs={"content": [{"token": "", "logprob": lp} for lp in logprobs]},
                  prompt_token_ids=prompt_token_ids, token_ids=token_ids)


def _apply_record(scope: CaptureScope, call: ModelCall, records: dict[str, Any]) -> None:
    record = records.get(call.record_id or "")
    if record is None:
        scope.error(f"the backend has no tokens for call {call.record_id} (evicted, or another server); "
                    "the turn is kept as a message and not trained on")
        return
    call.choice = exact_choice(call, record["prompt_token_ids"], record["token_ids"], record["logprobs"])


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


_http = httpx.Client(timeout=60)  # shared: building a client per capture costs ~20 ms


def fetch_tokens(scopes: list[CaptureScope]) -> None:
    """Fetch the exact tokens of the scopes' calls, one request per backend however many scopes,
    and put each in place of its assembled reply."""
    owner = {id(call): scope for scope in scopes for call in scope.calls}
    for (endpoint, api_key), calls in _requests([call for scope in scopes for call in scope.calls]).items():
        try:
            response = _http.post(f"{endpoint}/art/token_records", json={"ids": [c.record_id for c in calls]},
                                  headers=_headers(api_key))
            response.raise_for_status()
        except httpx.HTTPError as error:
            for scope in dict.fromkeys(owner[id(c)] for c in calls):
                scope.error(f"fetching tokens from {endpoint} failed: {error!r}")
            continue
        records = response.json()["records"]
        for call in calls:
            _apply_record(owner[id(call)], call, records)
    for scope in scopes:
        for items, index, call in scope.placeholders:
            if call.choice is not None:
                items[index] = call.choice


_deferred: ContextVar[list[CaptureScope] | None] = ContextVar("art_capture_deferred", default=None)


@contextmanager
def deferred_token_fetch(pending: list[CaptureScope]) -> Iterator[None]:
    """Captures that exit inside leave their token fetch to the caller, who later calls
    `fetch_tokens(pending)` once for all of them: `gather_trajectory_groups` fetches once per
    group, not once per rollout. Until then each reply is a plain assistant message (what
    rewards read); the fetch puts its exact tokens in its place."""
    token = _deferred.set(pending)
    try:
        yield
    finally:
        _deferred.reset(token)


# ----- assembling histories ----------------------------------------------------------------


def _continues(call: ModelCall, last: ModelCall) -> bool:
    """Whether `call` carries on `last`'s conversation: its messages are `last`'s messages, then
    `last`'s reply, then more. (Token-level joining is the trainer's: a re-tokenized turn that
    no longer matches exactly starts a new training sequence within the same history.)"""
    seen = len(last.messages)
    return (len(call.messages) > seen and call.messages[:seen] == last.messages
            and _same_reply(call.messages[seen], last.response))


def _same_reply(message: dict[str, Any], reply: dict[str, Any]) -> bool:
    def calls(m: dict[str, Any]) -> list[tuple[Any, Any]]:
        return [(c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
                for c in m.get("tool_calls") or []]

    return message.get("role") == "assistant" and (message.get("content") or "") == (reply.get("content") or "") \
        and calls(message) == calls(reply)


def _conversations(calls: list[ModelCall]) -> list[list[ModelCall]]:
    conversations: list[list[ModelCall]] = []
    for call in calls:
        for conversation in conversations:
            if _continues(call, conversation[-1]):
                conversation.append(call)
                break
        else:
            conversations.append([call])
    return conversations


def _history(conversation: list[ModelCall]) -> tuple[History, list[tuple[int, ModelCall]]]:
    """The conversation as a history, and where the replies still waiting for tokens sit."""
    items: list[Any] = []
    waiting: list[tuple[int, ModelCall]] = []
    seen = 0
    for call in conversation:
        items += call.messages[seen:]
        if call.waits_for_tokens:
            waiting.append((len(items), call))
        items.append(call.choice if call.choice is not None else call.response)
        seen = len(call.messages) + 1  # its messages and the reply it produced
    return History(messages_and_choices=items, tools=conversation[0].tools), waiting


def _once(scope: CaptureScope, calls: list[ModelCall]) -> list[ModelCall]:
    """Each call once, its tokens the transport's: the one path a call's exact tokens take.

    An integration (ChatART, ARTLLM, the callback handlers) records a call for its structure (the
    LangGraph agent and node it ran in); the transport saw the same request and read its tokens
    from the reply. The two are joined by record id: the integration's call is kept, with the
    transport's tokens (or, where the reply lacked its logprobs, waiting for the same fetch), and
    the transport's copy is dropped. An integration's call the transport never saw has no tokens:
    said, and kept as a message."""
    copies = {call.record_id: call for call in calls if call.via_transport and call.record_id is not None}
    joined = set()
    for call in calls:
        if call.via_transport or not call.waits_for_tokens:
            continue
        copy = copies.get(call.record_id) if call.record_id is not None else None
        if copy is None:
            call.tokenless = True
            if call.record_id is None:
                scope.error(f"a call to {call.endpoint} returned no token record: point the chat model at an "
                            "art-backend and leave return_token_ids on (its default); the turn is kept as a "
                            "message and not trained on")
            else:
                scope.error(f"a call to {call.endpoint} (record {call.record_id}) was not seen at the HTTP "
                            "transport, so its tokens are unknown: send it through httpx, httpx2, requests or "
                            "aiohttp (the openai SDK's and LangChain's clients do); the turn is kept as a "
                            "message and not trained on")
            continue
        joined.add(call.record_id)
        if copy.choice is not None:
            call.choice = copy.choice.model_copy(update={"message": call.response,
                                                         "finish_reason": call.finish_reason})
    return [call for call in calls if not (call.via_transport and call.record_id in joined)]


def assemble(scope: CaptureScope) -> None:
    """Turn the recorded calls into the trajectory's main and additional histories."""
    with scope._lock:  # closed: no call joins now, but one may have just been added from another thread
        calls = list(scope.calls)
    scope.calls = _once(scope, calls)  # outside the lock, which the errors it reports take
    calls = sorted(scope.calls, key=lambda c: c.started)
    trajectory = scope.trajectory
    trajectory.metrics["model_calls"] = len(calls)
    if not calls:
        return
    agents: dict[str, list[ModelCall]] = {}
    for call in calls:
        agents.setdefault(call.agent, []).append(call)
    main_agent = "" if "" in agents else calls[0].agent
    ordered = [main_agent, *(a for a in agents if a != main_agent)]
    built = [(agent, *_history(c)) for agent in ordered for c in _conversations(agents[agent])]
    (_, main, main_waiting), others = built[0], built[1:]
    offset = len(trajectory.messages_and_choices)
    trajectory.messages_and_choices += main.messages_and_choices
    trajectory.tools = trajectory.tools or main.tools
    trajectory.additional_histories += [history for _, history, _ in others]
    # where each reply waiting for its tokens sits, in the lists the trajectory now holds
    scope.placeholders += [(trajectory.messages_and_choices, offset + i, call) for i, call in main_waiting]
    scope.placeholders += [(history.messages_and_choices, i, call) for _, history, waiting in others
                           for i, call in waiting]
    if others:
        trajectory.metadata.setdefault("additional_history_agents", []).extend(a or "main" for a, _, _ in others)
    nodes = sorted({str(c.metadata["langgraph_node"]) for c in calls if c.metadata.get("langgraph_node")})
    if nodes:
        trajectory.metadata["langgraph_nodes"] = nodes


# ----- the context manager -----------------------------------------------------------------


class art_capture:  # noqa: N801 - used like a function: `with art_capture() as trajectory:`
    """Record every model call made inside into a `Trajectory` (sync `with` or `async with`).

    Calls from asyncio tasks created inside, and from LangChain's executor threads, are
    included; concurrent captures never mix. Nested captures are allowed: a call goes to the
    innermost one. An exception inside propagates; the partial trajectory stays available.
    A call that finishes after the capture exited (a task not awaited inside), and a capture
    that records nothing, are warned and counted in `metrics["capture_errors"]`.

    `teacher=True` records the calls to OpenAI-compatible servers that are not an art-backend as
    well (a stronger model whose runs become `train_sft` data), as plain messages without token
    ids; off by default, so that a judge or a helper model stays out of the trajectory.
    """

    def __init__(self, trajectory: Trajectory | None = None, *, teacher: bool = False, **metadata: Any) -> None:
        if not isinstance(teacher, bool):
            raise TypeError(f"art_capture(teacher={teacher!r}): True or False (record calls to servers that are "
                            "not an art-backend as messages without tokens)")
        self.trajectory = trajectory if trajectory is not None else Trajectory()
        self.trajectory.metadata.update(metadata)
        self.scope = CaptureScope(self.trajectory, teacher=teacher)
        self._token: Token[CaptureScope | None] | None = None

    def __enter__(self) -> Trajectory:
        _install_transport()
        _watch_frameworks()
        self._token = _current.set(self.scope)
        return self.trajectory

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close()
        self._finish(failed=exc_type is not None)
        if self._fetch_now():
            fetch_tokens([self.scope])

    async def __aenter__(self) -> Trajectory:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._close()
        self._finish(failed=exc_type is not None)
        if self._fetch_now():
            await asyncio.to_thread(fetch_tokens, [self.scope])

    def _close(self) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None

    def _finish(self, failed: bool) -> None:
        """Assemble the calls; `failed`: the body raised, which says more than an empty capture would."""
        self.scope.close()  # first: a call landing during assembly is late, not half-assembled
        try:
            assemble(self.scope)
        except Exception:  # a bug here must not eat the rollout: keep it visible on the trajectory
            self.scope.error("assembling the trajectory failed:\n" + traceback.format_exc())
        if not failed:
            self.scope.report_if_empty()

    def _fetch_now(self) -> bool:
        """Whether this exit must fetch missing tokens itself: not when none is missing, nor
        under a `deferred_token_fetch`, whose pending list the scope then joins."""
        if not any(call.waits_for_tokens for call in self.scope.calls):
            return False
        pending = _deferred.get()
        if pending is None:
            return True
        pending.append(self.scope)
        return False
