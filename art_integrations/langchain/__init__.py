"""LangChain / LangGraph integration: the `ChatART` drop-in model and `ARTCallbackHandler`.

Needs the `langgraph` extra: `pip install "art-integrations[langgraph]"`.
"""

from art_integrations.langchain.callback import ARTCallbackHandler
from art_integrations.langchain.chat_model import ChatART

__all__ = ["ARTCallbackHandler", "ChatART"]
