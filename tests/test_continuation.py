"""Token-in continuation: a prompt that replays an earlier prompt + completion keeps those exact
ids, so a multi-turn rollout trains as one sequence (backend/art_backend/continuation.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from array import array
from collections import defaultdict
from pathlib import Path
from typing import Any

import openai
import pytest
from art_backend.chat_format import ChatFormatter
from art_backend.app import build_app
from art_backend.config import BackendSettings
from art_backend.continuation import TokenContinuations, turn_bytes
from art_backend.engine.torch_engine import TorchEngine
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from art_integrations import Trajectory, art_capture
from art_integrations.langchain import ChatART
from tests.conftest import ServerThread
from tests.test_langgraph import react_agent, sequences

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning",
                                        "ignore:create_react_agent has been moved")

TINY = "tiny-random-smollm2"
EMBEDDED = "SmolLM2-135M-Instruct"
TOKEN_IDS = {"return_token_ids": True}
CITY_TOOL = {  # an enum keeps the random tiny model's forced call short and well-formed
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                       "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tiny_client(tiny_server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def smol_tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's tokenizer


def is_canonical(tokenizer: Any, ids: list[int]) -> bool:
    """Whether tokenizing the text of `ids` gives `ids` back (re-rendering would keep them)."""
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return tokenizer.encode(text, add_special_tokens=False) == ids


def forced_call(client: openai.OpenAI, question: str, tokenizer: Any) -> tuple[list[dict[str, Any]], Any]:
    """A grammar-forced tool call whose reply is not the canonical tokenization of its text
    (the random tiny model picks odd splits; the seed that shows one is searched, not assumed)."""
    messages = [{"role": "user", "content": question}]
    for seed in range(16):
        response = client.chat.completions.create(
            model=TINY, messages=messages, tools=[CITY_TOOL], tool_choice="required", temperature=1.0, seed=seed,
            max_tokens=40, extra_body=TOKEN_IDS)
        if response.choices[0].finish_reason == "tool_calls" and not is_canonical(tokenizer, response.choices[0].model_extra["token_ids"]):
            return messages, response
    raise AssertionError("no seed gave a non-canonical tool call")


def with_tool_result(messages: list[dict[str, Any]], assistant: dict[str, Any]) -> list[dict[str, Any]]:
    calls = assistant["tool_calls"]
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "21 C and sunny"} for call in calls]
    return [*messages, {"role": "assistant", "content": assistant.get("content"), "tool_calls": calls}, *results]


def earlier_ids(response: Any, index: int = 0) -> list[int]:
    return response.model_extra["prompt_token_ids"] + response.choices[index].model_extra["token_ids"]


# ----- over HTTP ------------------------------------------------------------------------


def test_a_non_canonical_reply_is_continued_with_its_exact_ids(tiny_client: openai.OpenAI, tiny_engine: TorchEngine) -> None:
    tokenizer = tiny_engine.tokenizer
    messages, first = forced_call(tiny_client, "Weather in Oslo, please?", tokenizer)
    second_messages = with_tool_result(messages, first.choices[0].message.model_dump(exclude_none=True))
    second = tiny_client.chat.completions.create(
        model=TINY, messages=second_messages, tools=[CITY_TOOL], tool_choice="none", max_tokens=8,
        extra_body=TOKEN_IDS)

    earlier = earlier_ids(first)
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt[: len(earlier)] == earlier
    assert second.usage.prompt_tokens == len(prompt)
    formatter = ChatFormatter(tokenizer)
    plain = formatter.render_ids(second_messages, [CITY_TOOL], "none")
    assert plain[: len(earlier)] != earlier  # re-tokenizing the text alone would have broken the prefix
    text = formatter.render(second_messages, [CITY_TOOL], "none")
    assert tokenizer.decode(prompt, skip_special_tokens=False) == tokenizer.decode(plain, skip_special_tokens=False) == text
    # only what the template wrote after the reply's own end-of-turn token was tokenized anew
    assert tokenizer.decode(prompt[len(earlier):]).startswith("\n<|im_start|>user\n<tool_response>")

    trajectory = Trajectory(messages_and_choices=messages, tools=[CITY_TOOL])
    trajectory.add_response(first)
    trajectory.messages_and_choices += second_messages[len(messages) + 1:]
    trajectory.add_response(second)
    count, stats = sequences(trajectory)
    assert (count, stats.prefix_breaks) == (1, 0)


def test_each_of_n_streamed_choices_is_continued_with_its_own_ids(tiny_client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Weather anywhere, three times?"}]
    stream = tiny_client.chat.completions.create(
        model=TINY, messages=messages, tools=[CITY_TOOL], tool_choice="required", n=3, temperature=1.0, seed=3,
        max_tokens=40, stream=True, extra_body=TOKEN_IDS)
    prompt_ids: list[int] = []
    token_ids: dict[int, list[int]] = defaultdict(list)
    calls: dict[int, list[dict[str, Any]]] = {}
    for chunk in stream:
        prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids") or []
        for choice in chunk.choices:
            token_ids[choice.index] += (choice.model_extra or {}).get("token_ids") or []
            if choice.delta.tool_calls:
                calls[choice.index] = [{key: value for key, value in call.model_dump(exclude_none=True).items() if key != "index"}
                                       for call in choice.delta.tool_calls]
    assert prompt_ids and sorted(calls) == [0, 1, 2]

    texts = {i: json.dumps([c["function"] for c in calls[i]]) for i in calls}
    for index in range(3):
        follow_up = with_tool_result(messages, {"content": None, "tool_calls": calls[index]})
        response = tiny_client.chat.completions.create(
            model=TINY, messages=follow_up, tools=[CITY_TOOL], tool_choice="none", max_tokens=4, extra_body=TOKEN_IDS)
        prompt = response.model_extra["prompt_token_ids"]
        # Two samples with the same text can only be told apart by their text, so either one's ids continue it.
        same_text = [i for i in calls if texts[i] == texts[index]]
        assert any(prompt[: len(prompt_ids) + len(token_ids[i])] == prompt_ids + token_ids[i] for i in same_text)


def test_an_edited_assistant_message_is_tokenized_plainly_and_counted_as_a_break(
        tiny_client: openai.OpenAI, tiny_engine: TorchEngine) -> None:
    tokenizer = tiny_engine.tokenizer
    messages, first = forced_call(tiny_client, "Weather in Rome? (edited later)", tokenizer)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    chosen = json.loads(assistant["tool_calls"][0]["function"]["arguments"])["city"]
    other = next(city for city in ("Paris", "Rome", "Oslo") if city != chosen)
    assistant["tool_calls"][0]["function"]["arguments"] = json.dumps({"city": other})  # the client rewrote history
    edited = with_tool_result(messages, assistant)
    second = tiny_client.chat.completions.create(
        model=TINY, messages=edited, tools=[CITY_TOOL], tool_choice="none", max_tokens=8, extra_body=TOKEN_IDS)

    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"] == ChatFormatter(tokenizer).render_ids(edited, [CITY_TOOL], "none")
    assert tokenizer.decode(second.model_extra["prompt_token_ids"]).count(f'"city": "{other}"') == 1

    trajectory = Trajectory(messages_and_choices=messages, tools=[CITY_TOOL])
    trajectory.add_response(first)
    trajectory.messages_and_choices += edited[len(messages) + 1:]
    trajectory.add_response(second)
    stats = TokenizeStats()
    assert len(tokenize_trajectory(trajectory, 1.0, "t", stats, 8192)) == 2 and stats.prefix_breaks == 1


@pytest.mark.parametrize(("server_fixture", "model", "max_tokens"), [("tiny_server", TINY, 40), ("server", EMBEDDED, 48)])
async def test_forced_tool_call_agent_rollouts_train_as_one_sequence_each(
        server_fixture: str, model: str, max_tokens: int, request: pytest.FixtureRequest) -> None:
    running: ServerThread = request.getfixturevalue(server_fixture)
    tokenizer = request.getfixturevalue("tiny_engine" if model == TINY else "embedded_engine").tokenizer
    llm = ChatART(model=model, base_url=f"{running.base_url}/v1", temperature=1.0, max_tokens=max_tokens, timeout=300)
    agent = react_agent(llm)  # turn 1 must call a tool (grammar-forced), turn 2 answers in words

    async def rollout(i: int) -> Trajectory:
        async with art_capture(rollout=i) as trajectory:
            await agent.ainvoke({"messages": [("user", f"What is the weather in Paris? (rollout {i})")]})
        return trajectory

    trajectories = await asyncio.gather(*(rollout(i) for i in range(8)))
    for trajectory in trajectories:
        first, second = trajectory.choices()
        assert first.message["tool_calls"] and second.prompt_token_ids
        count, stats = sequences(trajectory)
        assert (count, stats.prefix_breaks) == (1, 0), trajectory.metadata
    if model == TINY:  # the case continuation exists for: plain re-tokenizing would have broken these
        assert any(not is_canonical(tokenizer, t.choices()[0].token_ids) for t in trajectories)


# ----- the store itself ------------------------------------------------------------------


def ids_of(tokenizer: Any, *pieces: str) -> list[int]:
    """The pieces tokenized one by one: a split the tokenizer would not choose for their joined text."""
    return [i for piece in pieces for i in tokenizer.encode(piece, add_special_tokens=False)]


def test_the_longest_remembered_turn_wins(smol_tokenizer: Any) -> None:
    store = TokenContinuations(smol_tokenizer)
    call = ids_of(smol_tokenizer, "<|im_start|>", "get_t", "ime")
    call_then_word = call + ids_of(smol_tokenizer, " w", "eather")
    assert call != ids_of(smol_tokenizer, "<|im_start|>get_time")
    store.remember(call[:1], call[1:])
    store.remember(call, call_then_word[len(call):])

    assert store.tokenize("<|im_start|>get_time weather today") == call_then_word + ids_of(smol_tokenizer, " today")
    assert store.tokenize("<|im_start|>get_time today") == call + ids_of(smol_tokenizer, " today")
    assert store.tokenize("get_time weather") == ids_of(smol_tokenizer, "get_time weather")  # nothing starts it


def test_rollouts_that_wrote_one_text_each_continue_their_own_ids(smol_tokenizer: Any) -> None:
    """Two rollouts of a group made the same tool call with other splits: each one's next prompt
    carries its call's id back and goes on from its own ids, and a prompt without one gets the same
    turn whichever rollout finished last (the timing once decided it, and a seeded run parted)."""
    first = ids_of(smol_tokenizer, "<|im_start|>", "get_t", "ime<|im_end|>")
    second = ids_of(smol_tokenizer, "<|im_start|>", "get_", "time<|im_end|>")
    assert first != second and smol_tokenizer.decode(first) == smol_tokenizer.decode(second)
    text = "<|im_start|>get_time<|im_end|>\n4:30"
    rest = ids_of(smol_tokenizer, "\n4:30")

    def store_of(*finished: tuple[list[int], str]) -> TokenContinuations:
        store = TokenContinuations(smol_tokenizer)
        for ids, call in finished:
            store.remember(ids[:1], ids[1:], [call])
        return store

    in_order, reversed_order = store_of((first, "call_a"), (second, "call_b")), store_of((second, "call_b"),
                                                                                       (first, "call_a"))
    for store in (in_order, reversed_order):
        assert len(store) == 2
        assert store.tokenize(text, {"call_a"}) == first + rest
        assert store.tokenize(text, {"call_b", "call_older"}) == second + rest
        assert store.tokenize(text) == store.tokenize(text, {"call_unknown"}) == min(first, second) + rest
    in_order.remember(first[:1], first[1:], ["call_a"])  # the same turn again adds nothing
    assert len(in_order) == 2 and in_order.bytes_held == reversed_order.bytes_held
    # third and fourth rollouts drew the very ids of the one that is not the fallback: all three go on
    # from them, the other from its own
    shared, (other, other_call) = max((first, "call_a"), (second, "call_b")), min((first, "call_a"), (second, "call_b"))
    for call in ("call_c", "call_d"):
        in_order.remember(shared[0][:1], shared[0][1:], [call])
    assert len(in_order) == 2 and in_order.bytes_held == reversed_order.bytes_held
    for call in (shared[1], "call_c", "call_d"):
        assert in_order.tokenize(text, {call, "call_older"}) == shared[0] + rest
    assert in_order.tokenize(text, {other_call}) == in_order.tokenize(text) == other + rest


def test_the_byte_budget_evicts_the_least_recently_used_turn(smol_tokenizer: Any) -> None:
    turns = {city: ids_of(smol_tokenizer, "<|im_start|>", city[:2], city[2:]) for city in ("Paris", "Rome", "Oslo")}
    sizes = {city: turn_bytes(f"<|im_start|>{city}", array("i", ids)) for city, ids in turns.items()}
    store = TokenContinuations(smol_tokenizer, budget_bytes=sizes["Paris"] + sizes["Rome"])
    store.remember(turns["Paris"][:1], turns["Paris"][1:])
    store.remember(turns["Rome"][:1], turns["Rome"][1:])
    assert store.bytes_held == sizes["Paris"] + sizes["Rome"]
    assert store.tokenize("<|im_start|>Paris!")[:3] == turns["Paris"]  # Paris is now the most recently used
    store.remember(turns["Oslo"][:1], turns["Oslo"][1:])

    assert len(store) == 2 and store.bytes_held == sizes["Paris"] + sizes["Oslo"] <= store.budget_bytes
    assert store.tokenize("<|im_start|>Rome!") == ids_of(smol_tokenizer, "<|im_start|>Rome!")  # evicted
    assert store.tokenize("<|im_start|>Paris!")[:3] == turns["Paris"]
    assert store.tokenize("<|im_start|>Oslo!")[:3] == turns["Oslo"]
    store.remember(ids_of(smol_tokenizer, "a" * 400), ids_of(smol_tokenizer, "b"))  # more than the whole budget
    assert len(store) == 2 and store.bytes_held == sizes["Paris"] + sizes["Oslo"]  # kept out, evicting nothing


def test_the_continuation_budget_is_a_setting(tiny_model_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_BACKEND_CONTINUATIONS_BYTES", "12345")
    monkeypatch.setenv("ART_BACKEND_ENGINE", "torch")
    app = build_app(BackendSettings(model=str(tiny_model_dir), art_dir=tmp_path))
    assert app.state.chat.continuations.budget_bytes == 12345


def test_a_continuation_that_would_change_the_text_falls_back_to_plain_tokenization() -> None:
    """With a SentencePiece-style tokenizer (Llama 2's), a piece tokenized on its own gains a word
    boundary that its text does not have; the decoded check catches it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    backend.decoder = decoders.Metaspace(prepend_scheme="always")
    backend.train_from_iterator(["hello world again", "worldagain hello"], trainers.BpeTrainer(special_tokens=["<unk>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    store = TokenContinuations(tokenizer)
    turn = ids_of(tokenizer, "hello", "world")
    store.remember(turn[:1], turn[1:])
    assert store.tokenize("hello world") == turn

    text = "hello worldagain"  # replays the turn, then goes on without a space
    assert tokenizer.decode(turn + ids_of(tokenizer, "again")) != text  # what a blind continuation would say
    assert store.tokenize(text) == ids_of(tokenizer, text) and tokenizer.decode(store.tokenize(text)) == text


def test_concurrent_remember_and_tokenize_stay_consistent(smol_tokenizer: Any) -> None:
    store = TokenContinuations(smol_tokenizer, budget_bytes=4000)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(150):
                prompt = smol_tokenizer.encode(f"worker {n} turn {i}:", add_special_tokens=False)
                store.remember(prompt, smol_tokenizer.encode(" done<|im_end|>", add_special_tokens=False))
                text = f"worker {n} turn {i}: done<|im_end|>\nnext"
                assert smol_tokenizer.decode(store.tokenize(text)) == text
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert 0 < store.bytes_held <= store.budget_bytes and len(store) > 1
