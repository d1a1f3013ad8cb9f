"""Names on the wire between this client and an art-backend, in one module both sides import
(the backend imports it without loading the client's HTTP patching or the openai SDK)."""

from __future__ import annotations

BACKEND_HEADER = "x-art-backend"  # on every generated answer of an art-backend
TOKEN_LOGPROBS_HEADER = "x-art-token-logprobs"  # asks a backend for each token's logprob beside its id
