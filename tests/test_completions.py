"""`POST /v1/completions` on the tiny model (the torch engine; the vLLM engine is behind the same
route): a prompt string or token ids, `n`, legacy `logprobs`, stop strings and streaming, each
choice with its exact tokens; `echo`, `suffix` and several prompts refused by name; and a call
inside `art_capture()` recorded as a single-turn history per choice, with the exact tokens."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from art_integrations import art_capture
from tests.clients.http_calls import send
from tests.conftest import ServerThread

MODEL = "tiny-random-smollm2"


@pytest.fixture(scope="module")
def client(tiny_server: ServerThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused")


def records(tiny_server: ServerThread, ids: list[str]) -> dict[str, Any]:
    return httpx.post(f"{tiny_server.base_url}/v1/art/token_records", json={"ids": ids}).json()["records"]


async def test_a_prompt_string_is_completed_with_its_exact_tokens(client: openai.AsyncOpenAI,
                                                                  tiny_server: ServerThread) -> None:
    completion = await client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=6,
                                                 logprobs=2, seed=1)
    assert completion.object == "text_completion" and len(completion.choices) == 2
    prompt_ids = completion.model_extra["prompt_token_ids"]
    kept = records(tiny_server, [choice.model_extra["token_record_id"] for choice in completion.choices])
    for choice in completion.choices:
        extra = choice.model_extra
        record = kept[extra["token_record_id"]]
        assert record["prompt_token_ids"] == prompt_ids and record["token_ids"] == extra["token_ids"]
        assert choice.logprobs.token_logprobs == pytest.approx(record["logprobs"])
        assert len(choice.logprobs.tokens) == len(extra["token_ids"]) == len(choice.logprobs.top_logprobs)
        assert "".join(choice.logprobs.tokens) == choice.text and choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens == len(prompt_ids)


async def test_token_ids_are_the_prompt_as_given(client: openai.AsyncOpenAI) -> None:
    ids = [1, 2, 3, 4, 5]
    whole = await client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert whole.model_extra["prompt_token_ids"] == ids
    stream = await client.completions.create(model=MODEL, prompt=[ids], max_tokens=5, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].model_extra["prompt_token_ids"] == ids
    streamed = [token for chunk in chunks for choice in chunk.choices for token in choice.model_extra["token_ids"]]
    assert streamed == whole.choices[0].model_extra["token_ids"]  # greedy: the same reply
    assert "".join(choice.text for chunk in chunks for choice in chunk.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == len(streamed)


async def test_a_stop_string_ends_the_text(client: openai.AsyncOpenAI) -> None:
    free = await client.completions.create(model=MODEL, prompt="a b c", max_tokens=12, temperature=0)
    text = free.choices[0].text
    if len(text.strip()) < 2:
        pytest.skip(f"the tiny model's greedy reply {text!r} has nothing to stop at")
    stop = text.strip()[1]
    stopped = await client.completions.create(model=MODEL, prompt="a b c", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


@pytest.mark.parametrize(("extra", "named"), [({"echo": True}, "echo"), ({"suffix": "end"}, "suffix"),
                                              ({"prompt": ["one", "two"]}, "one prompt per request"),
                                              ({"best_of": 3}, "best_of")])
async def test_what_is_not_served_is_refused_by_name(client: openai.AsyncOpenAI, extra: dict[str, Any],
                                                     named: str) -> None:
    request: dict[str, Any] = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError, match=named) as refused:
        await client.completions.create(**request)
    assert refused.value.status_code == 400


async def test_a_completion_is_captured_as_a_single_turn_history(client: openai.AsyncOpenAI,
                                                                 tiny_server: ServerThread) -> None:
    url = f"{tiny_server.base_url}/v1/completions"
    async with art_capture() as trajectory:
        whole = await client.completions.create(model=MODEL, prompt="Tell me", n=2, max_tokens=4)
        streamed = await send("aiohttp", url, {"model": MODEL, "prompt": "Go on", "max_tokens": 4}, stream=True)
    assert not trajectory.logs and trajectory.metrics["model_calls"] == 3
    histories = trajectory.histories()
    assert [h.messages() for h in histories] == [
        [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": whole.choices[0].text}],
        [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": whole.choices[1].text}],
        [{"role": "user", "content": "Go on"}, {"role": "assistant", "content": streamed.text}]]
    turns = [h.choices()[0] for h in histories]
    assert [t.token_ids for t in turns] == [c.model_extra["token_ids"] for c in whole.choices] + [streamed.token_ids]
    assert turns[2].prompt_token_ids == streamed.prompt_token_ids
    assert all(len(t.token_logprobs or []) == len(t.token_ids or []) > 0 for t in turns)
