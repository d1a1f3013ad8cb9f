"""Fetching exact token ids from the backend after a rollout: the replies that came without their
logprobs (the first call to a backend no client named) get them in one request per backend at
capture exit (`fetch_tokens`), or once per group under `gather_trajectory_groups`
(`deferred_token_fetch`); `exact_choice` is a reply with its exact tokens, as the transport also
builds it from a reply that brought them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpx

from art_integrations.capture.scope import CaptureScope, ModelCall
from art_integrations.trajectory import Choice


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
