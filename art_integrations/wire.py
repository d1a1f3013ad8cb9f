"""Names on the wire between this client and an art-backend, in one module both sides import
(the backend imports it without loading the client's HTTP patching or the openai SDK), and the
loopback port a server either side starts listens on."""

from __future__ import annotations

import socket

BACKEND_HEADER = "x-art-backend"  # on every generated answer of an art-backend
TOKEN_LOGPROBS_HEADER = "x-art-token-logprobs"  # asks a backend for each token's logprob beside its id


def free_loopback_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server this process starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
