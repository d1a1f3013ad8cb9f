"""Assembling a capture's recorded calls into its Trajectory: each call once (`_once`, joining an
integration's call to the transport's copy of it), grouped by agent, within an agent into
conversations (a call continues one when its messages extend that conversation's last call and
reply), the main agent's first conversation the trajectory's own and every other one an
additional history (`assemble`).
"""

from __future__ import annotations

from typing import Any

from art_integrations.capture.scope import CaptureScope, ModelCall
from art_integrations.trajectory import History


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
