"""LangChain's standard conformance suites (`langchain-tests`) for `ChatART`: the unit suite, and
the integration suite against a real art-backend serving the embedded model.

The feature flags say what the docs (docs/integrations/langgraph.md, docs/backend/api.md) claim of
ChatART and the backend: tools with every `tool_choice`, structured output, JSON mode, token usage
(streams included) and what ChatOpenAI's message conversion adds (Anthropic-style blocks); text
only. A test is an expected failure only where the served 135M model lacks the capability, and its
marker says how.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from art_backend.engine.torch_engine import TorchEngine
from art_backend.server import create_app
from art_integrations.langchain import ChatART
from tests.chat_families import retemplate_model
from tests.conftest import ServerThread, _close


class ChatARTFlags:
    """What both suites are told about ChatART."""

    @property
    def chat_model_class(self) -> type[ChatART]:
        return ChatART

    @property
    def supports_json_mode(self) -> bool:
        return True  # `response_format` JSON, grammar-enforced

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True  # ChatOpenAI turns them into the text parts and tool calls the backend takes


class TestChatARTUnit(ChatARTFlags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "SmolLM2-135M-Instruct", "base_url": "http://127.0.0.1:8000/v1"}  # no request is made

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return ({"OPENAI_API_KEY": "sk-from-env", "OPENAI_API_BASE": "http://127.0.0.1:8000/v1"},
                {"model": "SmolLM2-135M-Instruct"},
                {"openai_api_key": "sk-from-env", "openai_api_base": "http://127.0.0.1:8000/v1"})


class SmolLM2Integration(ChatARTFlags, ChatModelIntegrationTests):
    """The integration suite's settings for the embedded 135M model (collected through the subclasses)."""

    base_url: str
    model_name: str
    override_name = "SmolLM2-135M-Instruct@override"

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def backend(cls, server: ServerThread, embedded_engine: TorchEngine) -> Iterator[None]:
        """The suite's properties take no fixtures: hand them the served URL through the class.
        A second name for the base model (as a registered model's step 0 is served) lets the
        model-override tests ask for a model other than the default."""
        cls.base_url = f"{server.base_url}/v1"
        cls.model_name = embedded_engine.base_model_name
        asyncio.run(embedded_engine.load_adapter(cls.override_name, None))
        yield
        asyncio.run(embedded_engine.remove_adapter(cls.override_name))

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # Greedy, so each test's outcome is the model's on every run. Greedy, the 135M model loops
        # inside a JSON string until the token budget (the suite sets none, and the context holds
        # 8192), leaving structured output nothing to parse; a frequency penalty, the usual
        # remedy, lets it finish.
        return {"model": self.model_name, "base_url": self.base_url, "temperature": 0, "max_tokens": 128,
                "frequency_penalty": 0.5}

    @property
    def model_override_value(self) -> str:
        return self.override_name

    @pytest.mark.xfail(reason="with tool_choice='auto' the 135M model answers the weather question in prose "
                              "instead of calling the tool", strict=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)


class TestChatARTIntegration(SmolLM2Integration):
    """Against the embedded model in its own format (ChatML, tools taught in Hermes markup)."""

    @pytest.mark.xfail(reason="the 135M model does not keep to the asked-for keys in JSON mode: it nests them "
                              "and goes on writing until max_tokens (the grammar keeps the JSON well-formed)",
                       strict=True)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)


@pytest.fixture(scope="module")
def llama3_engine(embedded_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchEngine]:
    """The embedded model speaking Llama 3.1's chat format: its template (JSON tool calls, tool results
    as `ipython` turns) and special tokens."""
    directory = retemplate_model("llama3_1", embedded_model_dir, tmp_path_factory.mktemp("llama3") / "SmolLM2-llama3")
    engine = TorchEngine(directory)
    yield engine
    _close(engine)


class TestChatARTIntegrationLlama3Format(SmolLM2Integration):
    """The integration suite once more on a family that is not Hermes: every request is rendered by
    Llama 3.1's template, and forced calls are written and read as its JSON calls."""

    override_name = "SmolLM2-llama3@override"

    @pytest.fixture(autouse=True, scope="class")
    @classmethod
    def backend(cls, llama3_engine: TorchEngine) -> Iterator[None]:
        assert llama3_engine.chat_formatter(None, None).tool_call_parser == "llama3_json"
        with ServerThread(create_app(llama3_engine)) as server:
            cls.base_url = f"{server.base_url}/v1"
            cls.model_name = llama3_engine.base_model_name
            asyncio.run(llama3_engine.load_adapter(cls.override_name, None))
            yield
            asyncio.run(llama3_engine.remove_adapter(cls.override_name))
