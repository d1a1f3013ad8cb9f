"""The drop-in clients take their settings the way their frameworks do: the API key from any of
LangChain's or LlamaIndex's ways of giving it (a backend started with `--api-key` then answers
them), a placeholder where none is given (a local backend needs none), and token usage on
streamed replies. ChatART's streamed usage is checked by LangChain's standard suite
(test_langchain_standard.py)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from llama_index.core.llms import ChatMessage

from art_backend.engine.torch_engine import TorchEngine
from art_backend.server import create_app
from art_integrations.langchain import ChatART
from art_integrations.llamaindex import ARTLLM
from tests.conftest import ServerThread

MODEL = "tiny-random-smollm2"
KEY = "s3cret"


@pytest.fixture(scope="module")
def keyed_server(tiny_engine: TorchEngine) -> Iterator[ServerThread]:
    with ServerThread(create_app(tiny_engine, api_key=KEY)) as running:
        yield running


@pytest.mark.parametrize("given", [{"api_key": KEY}, {"openai_api_key": KEY}, {}],
                         ids=["api_key", "openai_api_key", "env"])
def test_chat_art_takes_the_key_every_way_chat_openai_does(keyed_server: ServerThread, given: dict[str, str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY if not given else "wrong")  # an argument wins over the environment
    llm = ChatART(model=MODEL, base_url=f"{keyed_server.base_url}/v1", max_tokens=2, **given)
    assert llm.invoke("x").response_metadata["token_usage"]["completion_tokens"] > 0


def test_chat_art_without_a_key_starts_and_a_keyed_backend_refuses_it(keyed_server: ServerThread,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)  # ChatOpenAI itself would refuse to start
    llm = ChatART(model=MODEL, base_url=f"{keyed_server.base_url}/v1", max_tokens=2, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        llm.invoke("x")


@pytest.mark.parametrize("given", [{"api_key": KEY}, {}], ids=["api_key", "env"])
def test_art_llm_takes_the_key_as_openai_does(keyed_server: ServerThread, given: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY if not given else "wrong")
    # the context window is read from the keyed backend too
    llm = ARTLLM(model=MODEL, api_base=f"{keyed_server.base_url}/v1", max_tokens=2, **given)
    assert llm.chat([ChatMessage(role="user", content="x")]).additional_kwargs["completion_tokens"] > 0


async def test_art_llm_streams_end_with_the_usage(tiny_server: ServerThread) -> None:
    llm = ARTLLM(model=MODEL, api_base=f"{tiny_server.base_url}/v1", max_tokens=5, temperature=0)
    messages = [ChatMessage(role="user", content="Hi")]
    streamed = list(llm.stream_chat(messages))
    astreamed = [r async for r in await llm.astream_chat(messages)]
    for responses in (streamed, astreamed):
        usage = responses[-1].additional_kwargs  # where LlamaIndex's OpenAI puts a response's usage
        assert 0 < usage["completion_tokens"] <= 5
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert responses[-1].message.content == responses[-2].message.content  # the text is whole at the end


async def test_a_backend_keeps_one_openai_client_per_event_loop_and_closes_it(tiny_server: ServerThread) -> None:
    """As ART's model.openai_client(): the same client each call on a loop (a client per call,
    dropped unclosed, left rollouts on newer clients waiting for replies: backend.py), a fresh one
    when asked for other settings, and it is closed with the backend."""
    import asyncio

    from art_integrations import RemoteBackend

    backend = RemoteBackend(tiny_server.base_url)
    client = backend.openai_client()
    assert backend.openai_client() is client
    assert backend.openai_client(max_retries=0) is not client
    assert (await client.models.list()).data
    other_loop = await asyncio.to_thread(lambda: asyncio.run(_client_of(backend)))
    assert other_loop is not client
    await backend.close()
    assert client.is_closed()
    assert backend.openai_client() is not client


async def test_a_registered_model_hands_out_its_backends_kept_client(tiny_training_server: ServerThread) -> None:
    """`model.openai_client()` at its backend's endpoint is the backend's (kept, closed with it); at
    an endpoint of its own it is a client of its own."""
    from art_integrations import Model, RemoteBackend, TrainableModel

    backend = RemoteBackend(tiny_training_server.base_url)
    model = TrainableModel(name="kept-client", project="kept-client")
    await model.register(backend)
    client = model.openai_client()
    assert client is backend.openai_client() and model.openai_client() is client
    assert model.openai_client(max_retries=0) is not client
    elsewhere = Model(name="judge", project="kept-client", inference_base_url="http://127.0.0.1:9/v1")
    assert str(elsewhere.openai_client().base_url) == "http://127.0.0.1:9/v1/"
    await backend.close()
    assert client.is_closed()


async def _client_of(backend: object) -> object:
    return backend.openai_client()  # type: ignore[attr-defined]
