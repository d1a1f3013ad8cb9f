"""Each model family's own tool-call and reasoning format, with its real chat template and special
tokens (tests/chat_families.py), on both engines: render -> forced call in the family's markup ->
parse -> tool result -> next turn, captured as one sequence where the template writes the turn back
as the model wrote it, else as a new sequence, counted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from art_backend.chat_format import ChatFormatError, ChatFormatter, ReplyStream
from art_backend.server import create_app
from art_backend.tool_formats import TOOL_CALL_PARSERS, tool_call_parser_for
from art_backend.training.tokenize import TokenizeStats, tokenize_trajectory
from art_integrations import Trajectory
from tests.chat_families import FAMILIES, build_family_model
from tests.conftest import ENGINES, ServerThread, _close, torch_engine, vllm_engine

CITY_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the current weather in a city",
                 "parameters": {"type": "object", "required": ["city"],
                                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}},
}
TIME_TOOL = {
    "type": "function",
    "function": {"name": "get_time", "description": "Local time in a city",
                 "parameters": {"type": "object", "required": ["city"],
                                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}}}},
}
QUESTION = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Weather in Oslo?"}]
# Qwen3 thinks unless told not to; a random model's thinking would not end within the test's tokens
NO_THINKING = {"qwen3": {"chat_template_kwargs": {"enable_thinking": False}}}
CALLS = {  # a call in each parser's markup, as the family's model writes it
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
}


@pytest.fixture(scope="module")
def family_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_model(family, tiny_model_dir, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def formatters(family_dirs: dict[str, Path]) -> dict[str, ChatFormatter]:
    return {family: ChatFormatter(AutoTokenizer.from_pretrained(path)) for family, path in family_dirs.items()}


# ----- the formats, without an engine ----------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_is_read_from_its_chat_template(family: str, formatters: dict[str, ChatFormatter]) -> None:
    formatter = formatters[family]
    assert formatter.supports_tools_natively
    assert (formatter.tool_call_parser, formatter.reasoning_parser) == (
        FAMILIES[family]["tool_call_parser"], FAMILIES[family]["reasoning_parser"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_call_in_the_family_markup_parses_and_renders_back(family: str, formatters: dict[str, ChatFormatter]) -> None:
    formatter = formatters[family]
    prompt = formatter.render_prompt(QUESTION, [CITY_TOOL], "auto", NO_THINKING.get(family, {}).get(
        "chat_template_kwargs"))
    parsed = formatter.parse(CALLS[formatter.tool_call_parser], prompt, [CITY_TOOL])
    assert parsed.parse_error is None and parsed.content is None and parsed.reasoning is None
    assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == [("get_weather", {"city": "Oslo"})]
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parsed.tool_calls]
    if family == "mistral_nemo":  # its template refuses any id but 9 letters and digits
        assert all(len(call["id"]) == 9 and call["id"].isalnum() for call in calls)
    next_turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "-3 C"}]
    rendered = formatter.render(next_turn, [CITY_TOOL], "auto")
    assert "-3 C" in rendered and '"Oslo"' in rendered.split("Weather in Oslo?")[-1]


def test_mistral_takes_the_ids_other_clients_make(formatters: dict[str, ChatFormatter]) -> None:
    call = {"id": "call_abcdefghijklmnopqrstuvwxyz", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "20 C"}]
    rendered = formatters["mistral_nemo"].render(messages, [CITY_TOOL], "auto")
    assert '"id": "rstuvwxyz"' in rendered and '"call_id": "rstuvwxyz"' in rendered


def test_a_template_refusal_is_a_clear_error(formatters: dict[str, ChatFormatter]) -> None:
    two_calls = [{"id": f"call_{i}", "type": "function",
                  "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
                 for i, city in enumerate(["Rome", "Oslo"])]
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": two_calls}]
    with pytest.raises(ChatFormatError, match="chat template refused.*only supports single tool-calls"):
        formatters["llama3_1"].render(messages, [CITY_TOOL], "auto")


def test_template_arguments_must_be_ones_the_template_reads(formatters: dict[str, ChatFormatter]) -> None:
    off = formatters["qwen3"].render_prompt(QUESTION, None, None, {"enable_thinking": False})
    assert off.text.endswith("<think>\n\n</think>\n\n") and off.reasoning_opened is False
    assert formatters["qwen3"].render_prompt(QUESTION).reasoning_opened is None
    with pytest.raises(ChatFormatError, match="enable_thinking.*reads no such name"):
        formatters["llama3_1"].render_prompt(QUESTION, None, None, {"enable_thinking": False})
    with pytest.raises(ChatFormatError, match="cannot set tools"):
        formatters["qwen3"].render_prompt(QUESTION, None, None, {"tools": []})


@pytest.mark.parametrize("reply", [
    "<think>\nThe user wants Oslo.\n</think>\n\nIt is cold.",
    "<think>\nStill thinking when the tokens ran out",
    "<think>\nCall it.\n</think>\n\n" + CALLS["hermes"],
])
def test_reasoning_streams_as_it_parses(reply: str, formatters: dict[str, ChatFormatter]) -> None:
    formatter = formatters["qwen3"]
    prompt = formatter.render_prompt(QUESTION, [CITY_TOOL])
    whole = formatter.parse(reply, prompt, [CITY_TOOL])
    assert whole.reasoning is not None and whole.reasoning.strip("\n").startswith(("The user", "Still", "Call it"))
    assert "<think>" not in (whole.content or "") and "</think>" not in (whole.content or "")
    for size in (1, 3, 7):
        stream = ReplyStream(formatter, prompt, [CITY_TOOL])
        pieces = [stream.feed(reply[i:i + size]) for i in range(0, len(reply), size)]
        end = stream.finish()
        assert "".join(r for r, _ in pieces) + (end.reasoning or "") == whole.reasoning
        assert (("".join(c for _, c in pieces) + (end.content or "")) or None) == whole.content
        assert [(c.name, c.arguments) for c in end.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_a_parser_named_for_the_wrong_template_is_refused(embedded_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    with pytest.raises(ChatFormatError, match="renders no tools.*hermes"):
        ChatFormatter(tokenizer, tool_call_parser="mistral")
    assert tool_call_parser_for("{{ messages }}", "llama3_json") == "llama3_json" and "llama3_json" in TOOL_CALL_PARSERS


# ----- on both engines, over HTTP --------------------------------------------------------


# the vLLM part of `make test` keeps a file's tests on one worker (`--dist loadfile`): a family's engine
# starts once (a vLLM start is ~40 s)
@pytest.fixture(scope="module", params=[pytest.param((family, engine.values[0]), id=f"{family}-{engine.id}",
                                                     marks=engine.marks)
                                        for engine in ENGINES for family in FAMILIES])
def family_server(request: pytest.FixtureRequest, family_dirs: dict[str, Path]) -> Iterator[tuple[str, Any]]:
    family, kind = request.param
    engine = torch_engine(family_dirs[family]) if kind == "torch" else vllm_engine(family_dirs[family])
    with ServerThread(create_app(engine)) as server:
        yield family, openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused"), engine
    _close(engine)


def _forced_call(client: openai.OpenAI, family: str, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=messages, tools=[CITY_TOOL, TIME_TOOL],
        tool_choice="required", temperature=1.0, seed=0, max_tokens=48,
        extra_body={"return_token_ids": True, **NO_THINKING.get(family, {}), **extra})


def test_a_forced_call_comes_back_as_tool_calls_in_the_family_markup(family_server: tuple[str, Any, Any]) -> None:
    family, client, engine = family_server
    response = _forced_call(client, family, QUESTION)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and "tool_call_parse_error" not in (choice.model_extra or {})
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    text = engine.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=False)
    markup = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]["}
    assert text.startswith(markup[FAMILIES[family]["tool_call_parser"]]), text

    streamed = client.chat.completions.create(
        model=response.model, messages=QUESTION, tools=[CITY_TOOL, TIME_TOOL], tool_choice="required",
        temperature=1.0, seed=0, max_tokens=48, stream=True,
        extra_body={"return_token_ids": True, **NO_THINKING.get(family, {})})
    calls = [call for chunk in streamed for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [(call.function.name, call.function.arguments)]


def test_the_next_turn_continues_the_calls_ids_or_counts_a_break(family_server: tuple[str, Any, Any]) -> None:
    family, client, _ = family_server
    first = _forced_call(client, family, QUESTION)
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": call["id"], "content": "-3 C"} for call in assistant["tool_calls"]]
    second_messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": assistant["tool_calls"]},
                       *results]
    second = client.chat.completions.create(
        model=first.model, messages=second_messages, tools=[CITY_TOOL, TIME_TOOL], max_tokens=8, seed=1,
        extra_body={"return_token_ids": True, **NO_THINKING.get(family, {})})

    trajectory = Trajectory(messages_and_choices=list(QUESTION), tools=[CITY_TOOL, TIME_TOOL])
    trajectory.add_response(first)
    trajectory.messages_and_choices += results
    trajectory.add_response(second)
    stats = TokenizeStats()
    sequences = tokenize_trajectory(trajectory, 1.0, "t", stats, 8192)
    if FAMILIES[family]["next_turn_continues"]:
        earlier = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        assert second.model_extra["prompt_token_ids"][:len(earlier)] == earlier
        assert (len(sequences), stats.prefix_breaks) == (1, 0)
    else:
        assert (len(sequences), stats.prefix_breaks) == (2, 1)


def test_reasoning_comes_back_apart_from_the_answer(family_server: tuple[str, Any, Any]) -> None:
    family, client, engine = family_server
    if FAMILIES[family]["reasoning_parser"] is None:
        pytest.skip(f"{family} writes no reasoning")
    think, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    ask = dict(model=client.models.list().data[0].id, messages=QUESTION, temperature=1.0, max_tokens=16,
               logit_bias={end: 8}, extra_body={"return_token_ids": True})
    for seed in range(16):  # a random model's reply that ends its reasoning after a few tokens, searched
        choice = client.chat.completions.create(**ask, seed=seed).choices[0]
        if end in choice.model_extra["token_ids"][2:]:
            break
    else:
        raise AssertionError("no seed ended the reasoning")
    message = choice.message
    reasoning = message.model_extra["reasoning_content"]
    text = engine.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    opening = "<think>" if text.startswith("<think>") else ""
    assert text == opening + reasoning + "</think>" + (message.content or "")
    assert message.model_extra["reasoning"] == reasoning and "</think>" not in reasoning

    reasoning_deltas, content_deltas = [], []
    for chunk in client.chat.completions.create(**ask, seed=seed, stream=True):
        for delta in (choice.delta for choice in chunk.choices):
            reasoning_deltas.append((delta.model_extra or {}).get("reasoning_content") or "")
            content_deltas.append(delta.content or "")
    assert "".join(reasoning_deltas) == reasoning and ("".join(content_deltas) or None) == message.content


def test_a_forced_call_may_follow_reasoning(family_server: tuple[str, Any, Any]) -> None:
    family, client, engine = family_server
    if FAMILIES[family]["reasoning_parser"] is None:
        pytest.skip(f"{family} writes no reasoning")
    think, end = engine.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    response = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=QUESTION, tools=[CITY_TOOL], tool_choice="required",
        temperature=1.0, seed=0, max_tokens=48, logit_bias={think: 100, end: 100}, extra_body={"return_token_ids": True})
    choice = response.choices[0]
    assert choice.model_extra["token_ids"][:2] == [think, end]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    assert choice.message.content is None


@pytest.mark.vllm
@pytest.mark.parametrize("family", FAMILIES)
def test_vllm_s_own_parsers_read_each_family_as_ours_do(family: str, family_dirs: dict[str, Path]) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test` runs this in .venv-vllm")
    from art_backend.tool_formats.vllm_parsers import use_vllm_parsers

    tokenizer = AutoTokenizer.from_pretrained(family_dirs[family])
    ours, theirs = ChatFormatter(tokenizer), ChatFormatter(tokenizer)
    use_vllm_parsers(theirs, tokenizer)
    assert type(theirs.parse_tool_calls).__name__ == "_VLLMToolCalls"  # vLLM's parser took the tokenizer
    assert (type(theirs.split_reasoning).__name__ == "_VLLMReasoning") == (ours.reasoning is not None)
    prompt = ours.render_prompt(QUESTION, [CITY_TOOL])
    reply = CALLS[ours.tool_call_parser]
    if ours.reasoning is not None:
        reply = "<think>\nOslo, then.\n</think>\n\n" + reply
    mine, vllms = ours.parse(reply, prompt, [CITY_TOOL]), theirs.parse(reply, prompt, [CITY_TOOL])
    assert [(c.name, c.arguments) for c in vllms.tool_calls] == [(c.name, c.arguments) for c in mine.tool_calls]
    assert (vllms.content, vllms.reasoning, vllms.parse_error) == (mine.content, mine.reasoning, None)
