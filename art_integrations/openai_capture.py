"""The transport capture's former home, kept for the names others import from it (the backend's
server, tests, benchmarks): the capture itself now covers every HTTP client, in
`art_integrations.transports`."""

from __future__ import annotations

from art_integrations.transports import install
from art_integrations.transports.core import BACKEND_HEADER, TOKEN_LOGPROBS_HEADER

__all__ = ["BACKEND_HEADER", "TOKEN_LOGPROBS_HEADER", "install"]
