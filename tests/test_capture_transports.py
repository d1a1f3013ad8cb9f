"""The capture at each HTTP client's transport (art_integrations/capture/transports/), against the tiny model
served over real HTTP: a hand-written request of httpx, httpx2 (where installed: tests/clients/ runs
these under the newest openai SDK, which sends through it), requests and aiohttp, sync and async,
streamed and not, is recorded with the exact tokens the server produced and no second request; a
call to another server is not recorded and leaves as it was written; other libraries' wrappers of
the same methods, installed before or after ours, keep running and the call is recorded once; the
first call to a backend no one named goes out untouched and is still recorded exactly."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from art_backend.server import create_app

from art_integrations import Trajectory, art_capture
from art_integrations.capture import tokens as capture_tokens
from art_integrations.capture.transports import patching
from art_integrations.wire import TOKEN_LOGPROBS_HEADER
from tests.clients.http_calls import CLIENTS, Received, installed, send
from tests.conftest import ServerThread

MODEL = "tiny-random-smollm2"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def records(base_url: str, ids: list[str]) -> dict[str, Any]:
    with httpx.Client() as client:  # inside no capture: nothing of this is recorded
        return client.post(f"{base_url}/v1/art/token_records", json={"ids": ids}).json()["records"]


def recorded_exactly(trajectory: Trajectory, received: list[Received], base_url: str) -> None:
    """Each call the client received is one recorded turn, with the server's exact ids and logprobs."""
    assert not trajectory.logs and trajectory.metrics["model_calls"] == len(received)
    turns = [history.choices()[0] for history in trajectory.histories()]
    kept = records(base_url, [r.record_id for r in received])  # type: ignore[misc]
    for turn, reply in zip(turns, received):
        assert turn.token_ids == reply.token_ids and turn.prompt_token_ids == reply.prompt_token_ids
        assert turn.token_ids == kept[reply.record_id]["token_ids"]
        assert turn.token_logprobs == pytest.approx(kept[reply.record_id]["logprobs"])


@pytest.fixture
def no_token_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fetch(*args: Any, **kwargs: Any) -> None:
        pytest.fail(f"a token fetch was made: {args}")
    monkeypatch.setattr(capture_tokens._http, "post", fetch)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_each_clients_call_is_recorded_with_its_exact_tokens(client: str, stream: bool, tiny_server: ServerThread,
                                                                    no_token_fetch: None) -> None:
    if not installed(client):
        pytest.skip(f"{client} is not installed here: `make test-clients` runs it beside the newest openai SDK")
    url = f"{tiny_server.base_url}/v1/chat/completions"
    async with art_capture() as trajectory:
        received = await send(client, url, CHAT, stream=stream)
    assert received.token_ids and received.record_id
    recorded_exactly(trajectory, [received], tiny_server.base_url)
    assert trajectory.messages() == [CHAT["messages"][0], {"role": "assistant", "content": received.text}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("client", CLIENTS)
async def test_each_clients_call_to_another_server_passes_through(client: str, stream: bool,
                                                                  tiny_engine: Any) -> None:
    if not installed(client):
        pytest.skip(f"{client} is not installed here: `make test-clients` runs it beside the newest openai SDK")
    with other(tiny_engine) as (server, seen):
        async with art_capture() as trajectory:
            received = await send(client, f"{server.base_url}/v1/chat/completions", CHAT, stream=stream)
    assert received.token_ids and trajectory.metrics == {"model_calls": 0, "capture_errors": 1}
    assert [TOKEN_LOGPROBS_HEADER in headers for headers in seen] == [False]  # sent as the agent wrote it


class Unmarked:
    """An app whose answers lack the backend's mark (another OpenAI-compatible server), noting the
    headers of each request it gets."""

    def __init__(self, app: Any, seen: list[dict[str, str]], mark: bool = False) -> None:
        self.app, self.seen, self.mark = app, seen, mark

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"].endswith("completions"):
            self.seen.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})

        async def unmarked(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not self.mark:
                message = {**message, "headers": [(k, v) for k, v in message["headers"]
                                                  if k.lower() != b"x-art-backend"]}
            await send(message)

        await self.app(scope, receive, unmarked)


def other(engine: Any, mark: bool = False) -> Any:
    """A server of its own on the tiny model (a port no test has used): another server, or with
    `mark` a backend nobody named to the capture; and the headers of the requests it got."""
    seen: list[dict[str, str]] = []

    class Running:
        def __enter__(self) -> tuple[ServerThread, list[dict[str, str]]]:
            self.server = ServerThread(Unmarked(create_app(engine), seen, mark)).__enter__()
            return self.server, seen

        def __exit__(self, *exc: object) -> None:
            self.server.__exit__(*exc)

    return Running()


async def test_the_first_call_to_an_unnamed_backend_leaves_untouched_and_is_recorded(tiny_engine: Any) -> None:
    """No one named this backend (no RemoteBackend on its URL): its first call goes out as written, and
    its reply's token ids and record id are recorded, the logprobs fetched at exit; later calls ask
    for them in the reply."""
    fetched: list[list[str]] = []
    post = capture_tokens._http.post

    def counting(url: str, **kwargs: Any) -> Any:
        fetched.append(kwargs["json"]["ids"])
        return post(url, **kwargs)

    with other(tiny_engine, mark=True) as (server, seen), pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture_tokens._http, "post", counting)
        url = f"{server.base_url}/v1/chat/completions"
        async with art_capture() as trajectory:
            received = [await send("httpx-async", url, CHAT), await send("requests", url, CHAT, stream=True)]
        recorded_exactly(trajectory, received, server.base_url)
    assert [TOKEN_LOGPROBS_HEADER in headers for headers in seen] == [False, True]
    assert fetched == [[received[0].record_id]]


@pytest.fixture
def restored() -> Iterator[Callable[[type, str], None]]:
    """`keep(owner, name)`: the method, and our record of wrapping it, are put back after the test."""
    saved: list[tuple[type, str, Any, Any]] = []

    def keep(owner: type, name: str) -> None:
        saved.append((owner, name, owner.__dict__[name], patching._installed.get((owner, name))))

    yield keep
    for owner, name, method, installed_as in reversed(saved):
        setattr(owner, name, method)
        if installed_as is None:
            patching._installed.pop((owner, name), None)
        else:
            patching._installed[(owner, name)] = installed_as


def foreign(original: Callable[..., Any], runs: list[str], name: str, wraps: bool = True) -> Callable[..., Any]:
    """Another library's instrumentation of a send (a tracer's): notes each call, then sends."""
    def send(self: Any, request: Any, **kwargs: Any) -> Any:
        runs.append(name)
        return original(self, request, **kwargs)
    return functools.wraps(original)(send) if wraps else send


@pytest.mark.parametrize("wraps", [True, False], ids=["functools.wraps", "bare"])
async def test_a_wrapper_installed_after_ours_keeps_both(wraps: bool, tiny_server: ServerThread,
                                                         restored: Callable[[type, str], None]) -> None:
    restored(httpx.Client, "send")
    with art_capture():  # ours is installed
        pass
    runs: list[str] = []
    httpx.Client.send = foreign(httpx.Client.send, runs, "tracer", wraps)  # type: ignore[method-assign]
    tracer = httpx.Client.send
    url = f"{tiny_server.base_url}/v1/chat/completions"
    async with art_capture() as trajectory:
        received = await send("httpx", url, CHAT)
    assert httpx.Client.send is tracer and runs == ["tracer"]  # the second capture left it in place
    recorded_exactly(trajectory, [received], tiny_server.base_url)


async def test_a_wrapper_installed_before_ours_keeps_both(tiny_server: ServerThread,
                                                          restored: Callable[[type, str], None]) -> None:
    """As if the tracer had instrumented httpx before the first capture: ours wraps it. When the tracer
    un-instruments (putting back what it wrapped), the next capture wraps the send again."""
    restored(httpx.Client, "send")
    with art_capture():
        pass
    original = httpx.Client.send
    while getattr(original, patching.MARK, False):
        original = original.__wrapped__  # type: ignore[attr-defined]
    httpx.Client.send = original  # type: ignore[method-assign]
    patching._installed.pop((httpx.Client, "send"))
    runs: list[str] = []
    httpx.Client.send = foreign(original, runs, "tracer")  # type: ignore[method-assign]
    url = f"{tiny_server.base_url}/v1/chat/completions"
    async with art_capture() as trajectory:
        received = await send("httpx", url, CHAT)
    assert getattr(httpx.Client.send, patching.MARK) and runs == ["tracer"]
    recorded_exactly(trajectory, [received], tiny_server.base_url)
    httpx.Client.send = original  # type: ignore[method-assign]  # the tracer un-instruments
    async with art_capture() as again:
        received = await send("httpx", url, CHAT, stream=True)
    recorded_exactly(again, [received], tiny_server.base_url)


async def test_a_second_copy_of_ours_on_one_call_records_it_once(tiny_server: ServerThread,
                                                                 restored: Callable[[type, str], None]) -> None:
    """Where our wrapper ends up twice on one call path (installed again above a tracer that hides
    what it wraps), the inner copy passes the request by: the call is recorded once."""
    from art_integrations.capture.transports import httpx_clients

    restored(httpx.AsyncClient, "send")
    with art_capture():
        pass
    httpx.AsyncClient.send = httpx_clients._async_send(httpx.AsyncClient.send,  # type: ignore[method-assign]
                                                       httpx_clients._tees["httpx"][1])
    url = f"{tiny_server.base_url}/v1/chat/completions"
    async with art_capture() as trajectory:
        received = await send("httpx-async", url, CHAT, stream=True)
    recorded_exactly(trajectory, [received], tiny_server.base_url)


def test_outside_a_capture_each_send_is_the_clients_own(tiny_server: ServerThread) -> None:
    import requests

    with art_capture():
        pass
    with requests.post(f"{tiny_server.base_url}/v1/chat/completions", json={**CHAT, "stream": True},
                       stream=True, timeout=60) as response:
        assert type(response.raw).__name__ == "HTTPResponse"  # not teed
        assert TOKEN_LOGPROBS_HEADER not in response.request.headers
        assert response.content
