"""One generation request sent by each HTTP client the capture covers, written as a hand-made agent
writes it (no SDK, no extra body), and read back the way such an agent reads it: shared by the
capture's transport tests in .venv (tests/test_capture_transports.py) and in the newest-clients
venv (tests/clients/), so both check the same calls.

`send(client, url, body, stream)` returns what the client received: the reply's token ids (a
stream's joined), its prompt's ids and its record id, to compare with what the capture recorded.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

SYNC = ("httpx", "httpx2", "requests")
ASYNC = ("httpx-async", "httpx2-async", "aiohttp")
CLIENTS = (*SYNC, *ASYNC)


def installed(client: str) -> bool:
    """Whether `client`'s library imports here (httpx2 is not in .venv, which pins the openai SDK 2.x)."""
    return importlib.util.find_spec(client.removesuffix("-async")) is not None


@dataclass
class Received:
    """What the client read: a chat completion's or a text completion's first choice."""

    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    record_id: str | None = None
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def _read(received: Received, event: dict[str, Any]) -> None:
    received.prompt_token_ids = event.get("prompt_token_ids", received.prompt_token_ids)
    for choice in event.get("choices") or []:
        if choice.get("index", 0):
            continue
        received.token_ids += choice.get("token_ids") or []
        message = choice.get("message") or choice.get("delta") or {}
        received.record_id = message.get("id") or choice.get("token_record_id") or received.record_id
        received.text += message.get("content") or choice.get("text") or ""


def _lines(received: Received, lines: list[str]) -> Received:
    for line in lines:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            _read(received, json.loads(line[5:]))
    return received


def _whole(received: Received, reply: dict[str, Any]) -> Received:
    _read(received, reply)
    return received


async def send(client: str, url: str, body: dict[str, Any], stream: bool = False,
               headers: dict[str, str] | None = None) -> Received:
    """POST `body` to `url` with `client` ("httpx", "httpx2-async", "requests", "aiohttp", ...)."""
    body = {**body, "stream": stream}
    headers = headers or {}
    if client in ("httpx", "httpx2"):
        module = importlib.import_module(client)
        with module.Client(timeout=60) as http:
            if stream:
                with http.stream("POST", url, json=body, headers=headers) as response:
                    response.raise_for_status()
                    return _lines(Received(headers=dict(response.headers)), list(response.iter_lines()))
            response = http.post(url, json=body, headers=headers)
            response.raise_for_status()
            return _whole(Received(headers=dict(response.headers)), response.json())
    if client in ("httpx-async", "httpx2-async"):
        module = importlib.import_module(client.removesuffix("-async"))
        async with module.AsyncClient(timeout=60) as http:
            if stream:
                async with http.stream("POST", url, json=body, headers=headers) as response:
                    response.raise_for_status()
                    lines = [line async for line in response.aiter_lines()]
                    return _lines(Received(headers=dict(response.headers)), lines)
            response = await http.post(url, json=body, headers=headers)
            response.raise_for_status()
            return _whole(Received(headers=dict(response.headers)), response.json())
    if client == "requests":
        import requests

        # a sync client in an async test, as an agent that blocks its loop would (the server runs elsewhere)
        with requests.post(url, json=body, headers=headers, stream=stream, timeout=60) as response:  # noqa: ASYNC210
            response.raise_for_status()
            received = Received(headers=dict(response.headers))
            if stream:
                return _lines(received, [line.decode() for line in response.iter_lines()])
            return _whole(received, response.json())
    if client == "aiohttp":
        import aiohttp

        async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as response:
            response.raise_for_status()
            received = Received(headers=dict(response.headers))
            if stream:
                return _lines(received, [line.decode().rstrip("\r\n") async for line in response.content])
            return _whole(received, await response.json())
    raise ValueError(f"unknown client {client!r}; one of {CLIENTS}")
