"""LlamaIndex integration: the `ARTLLM` drop-in model and the `ARTEventHandler` instrumentation.

Needs the `llamaindex` extra: `pip install "art-integrations[llamaindex]"`.
"""

from art_integrations.llamaindex.handler import ARTEventHandler, instrument
from art_integrations.llamaindex.llm import ARTLLM

__all__ = ["ARTLLM", "ARTEventHandler", "instrument"]
