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
header, with its exact tokens and logprobs read from the reply: the one way a call's tokens reach a
trajectory. A call ChatART, ARTLLM or a callback handler records too is one call
(`capture.assembly._once`, by token record id): theirs names the agent it ran in, the tokens are
these. A client none of these adapters covers (a websocket, gRPC, another HTTP library) is not
seen: the capture that then records nothing says what to do (`capture.scope.NO_CALLS`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

logger = logging.getLogger(__name__)

# client module -> the adapter module that wraps it (`install(client_module)`)
ADAPTERS = {
    "httpx": "art_integrations.capture.transports.httpx_clients",
    "httpx2": "art_integrations.capture.transports.httpx_clients",
    "requests": "art_integrations.capture.transports.requests_client",
    "aiohttp": "art_integrations.capture.transports.aiohttp_client",
}


def _wrap(name: str, client: ModuleType) -> None:
    importlib.import_module(ADAPTERS[name]).install(client)


class WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps a supported client the moment it is imported, when that is after the first capture (an
    agent that imports aiohttp inside its rollout): its calls in that very capture are recorded.
    Looks only at the top-level names in ADAPTERS, and costs nothing but at their import."""

    def __init__(self) -> None:
        self.finding: set[str] = set()

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ADAPTERS or fullname in self.finding:
            return None
        self.finding.add(fullname)  # another hook that asks the meta path in turn gets None from us
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self.finding.discard(fullname)
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_wrap(module: ModuleType) -> None:
            exec_module(module)
            try:
                _wrap(fullname, module)
            except Exception:  # the agent's import must not fail for the capture: said, and left unwrapped
                logger.warning("art_capture cannot wrap %s (imported inside a capture): its calls are not "
                               "recorded", fullname, exc_info=True)

        loader.exec_module = exec_then_wrap  # type: ignore[union-attr]  # this spec's loader only
        return spec


_hook = WrapOnImport()


def install() -> None:
    """Wrap the sends of every supported HTTP client the process has loaded, and have the others
    wrapped as they are imported. Cheap when done: each wrap is idempotent."""
    for name in ADAPTERS:
        client = sys.modules.get(name)
        if client is not None:
            _wrap(name, client)
    if _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


__all__ = ["ADAPTERS", "install"]
