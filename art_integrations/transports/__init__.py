"""Capture at the HTTP transport: every generation request an agent sends to an art-backend inside
`art_capture()` is recorded, whatever framework or HTTP client made it, with no handler, wrapper
or `extra_body`.

Agents reach the model through one of a few HTTP clients: the openai SDK 2.x (and LangChain's
ChatOpenAI, LlamaIndex, LiteLLM's OpenAI path) through httpx, the openai SDK 3.x (the Agents SDK,
PydanticAI, smolagents with it) through httpx2, hand-written agents through requests or aiohttp.
Each has an adapter beside this module that wraps the one method all its requests pass through;
`install()` wraps those of the libraries the process has loaded, once each (see patching.py for
how that composes with other libraries' wrappers). Outside a capture a wrapped method costs one
context-variable read.

Inside a capture, a POST to a chat-completions, Responses or completions path is looked at; what
it becomes is core.py's: recorded only where the reply carries the backend's `X-Art-Backend`
header, with its exact tokens and logprobs read from the reply. ChatART's own requests (marked
`X-Art-Recorded-By`) pass by: ChatART records them itself. A call a callback handler records too
is kept once (`capture._once`, by token record id). A client none of these adapters covers (a
websocket, gRPC, another HTTP library) is not seen: the capture that then records nothing says
what to do (`capture.NO_CALLS`).
"""

from __future__ import annotations

import importlib
import sys

from art_integrations.transports.core import BACKEND_HEADER, RECORDED_BY_HEADER, TOKEN_LOGPROBS_HEADER

# client module -> the adapter module that wraps it (`install(client_module)`)
ADAPTERS = {
    "httpx": "art_integrations.transports.httpx_clients",
    "httpx2": "art_integrations.transports.httpx_clients",
    "requests": "art_integrations.transports.requests_client",
    "aiohttp": "art_integrations.transports.aiohttp_client",
}


def install() -> None:
    """Wrap the sends of every supported HTTP client the process has loaded (a client loaded later
    is wrapped by the next capture). Cheap when done: each wrap is idempotent."""
    for name, adapter in ADAPTERS.items():
        client = sys.modules.get(name)
        if client is not None:
            importlib.import_module(adapter).install(client)


__all__ = ["ADAPTERS", "BACKEND_HEADER", "RECORDED_BY_HEADER", "TOKEN_LOGPROBS_HEADER", "install"]
