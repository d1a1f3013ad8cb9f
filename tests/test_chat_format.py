from __future__ import annotations

import json
from pathlib import Path

import pytest

from art_backend.chat_format import ChatFormatError, ChatFormatter, Prompt, ReplyStream
from art_backend.tool_formats import new_tool_call_id
from art_backend.tool_formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
            }
            for i, city in enumerate(["Paris", "Oslo"])
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9C"}]},
]
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_dir)


@pytest.fixture(scope="module")
def fmt(tokenizer) -> ChatFormatter:
    return ChatFormatter(tokenizer)


def _call(name: str, arguments: dict) -> str:
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def _stream(fmt: ChatFormatter) -> ReplyStream:
    return ReplyStream(fmt, Prompt(""), tools=[WEATHER_TOOL])


def test_smollm2_has_no_native_tools(fmt):
    assert fmt.supports_tools_natively is False


def test_render_without_tools_matches_model_template(fmt, tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert fmt.render(messages) == expected
    developer = fmt.render([{"role": "developer", "content": "Be brief."}, *messages])
    assert developer.startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_render_with_tools_writes_hermes_prompt(fmt):
    text = fmt.render(TOOL_TURNS, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\n# Tools\n")  # no default SmolLM system prompt
    assert "SmolLM" not in text
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in text
    calls = _call("get_weather", {"city": "Paris"}) + "\n" + _call("get_weather", {"city": "Oslo"})
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in text  # the model's own markup
    responses = "<tool_response>\n18C\n</tool_response>\n<tool_response>\n9C\n</tool_response>"
    assert f"<|im_start|>user\n{responses}<|im_end|>\n<|im_start|>assistant\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_render_appends_tools_to_existing_system(fmt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = fmt.render(messages, tools=[WEATHER_TOOL])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_render_ids_decode_to_render_text(fmt, tokenizer):
    text = fmt.render(TOOL_TURNS, tools=[WEATHER_TOOL])
    ids = fmt.render_ids(TOOL_TURNS, tools=[WEATHER_TOOL])
    assert tokenizer.decode(ids) == text  # exact, so no extra BOS was added
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") != ids[1]


def test_required_tools(fmt):
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    tools = [WEATHER_TOOL, other]
    assert fmt.required_tools(tools, None) is fmt.required_tools(tools, "auto") is fmt.required_tools(tools, "none") is None
    assert fmt.required_tools(tools, "required") == tools
    assert fmt.required_tools(tools, {"type": "function", "function": {"name": "get_time"}}) == [other]
    with pytest.raises(ChatFormatError, match="tool_choice"):
        fmt.required_tools(tools, "sometimes")
    with pytest.raises(ChatFormatError, match="non-empty"):
        fmt.required_tools(None, "required")


def test_render_rejects_bad_input(fmt):
    image = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(ChatFormatError, match="image_url.*only text parts"):
        fmt.render([{"role": "user", "content": image}])
    with pytest.raises(ChatFormatError, match="role 'robot'"):
        fmt.render([{"role": "robot", "content": "beep"}])
    bad_call = {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
    bad_args = {"role": "assistant", "tool_calls": [bad_call]}
    with pytest.raises(ChatFormatError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        fmt.render([{"role": "user", "content": "x"}, bad_args])
    unknown = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(ChatFormatError, match="not in `tools`"):
        fmt.render([{"role": "user", "content": "x"}], [WEATHER_TOOL], unknown)
    with pytest.raises(ChatFormatError, match="needs a non-empty `tools`"):
        fmt.render([{"role": "user", "content": "x"}], None, "required")


def test_parse_plain_text(fmt):
    parsed = fmt.parse("Just an answer, a < b.")
    assert (parsed.content, parsed.tool_calls, parsed.parse_error) == ("Just an answer, a < b.", [], None)


def test_parse_one_call(fmt):
    parsed = fmt.parse(_call("get_weather", {"city": "Paris"}))
    assert parsed.content is None and parsed.parse_error is None
    [call] = parsed.tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("call_") and len(call.id) == 29


def test_parse_parallel_calls_with_content(fmt):
    paris, oslo = _call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Oslo"})
    text = f"Let me check.\n{paris}\n{oslo}"
    parsed = fmt.parse(text)
    assert parsed.content == "Let me check."
    assert [json.loads(c.arguments)["city"] for c in parsed.tool_calls] == ["Paris", "Oslo"]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_parse_missing_close_tag(fmt):
    parsed = fmt.parse('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n')
    assert parsed.parse_error is None
    assert parsed.tool_calls[0].arguments == '{"city": "Paris"}'


def test_parse_arguments_as_string_and_parameters_alias(fmt):
    parsed = fmt.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"x": 1}'
    parsed = fmt.parse('<tool_call>{"name": "f", "parameters": {"x": "é"}}</tool_call>')
    assert parsed.tool_calls[0].arguments == '{"x": "é"}'


def test_parse_close_tag_inside_a_string_argument(fmt):
    note = {"text": "wrap calls in <tool_call></tool_call> tags"}
    parsed = fmt.parse("Writing it down.\n" + _call("write_note", note) + "\n" + _call("get_weather", {"city": "Oslo"}))
    assert parsed.parse_error is None and parsed.content == "Writing it down."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("write_note", note), ("get_weather", {"city": "Oslo"})]
    unclosed = fmt.parse('<tool_call>\n{"name": "write_note", "arguments": {"text": "a </tool_call> b"}}')
    assert json.loads(unclosed.tool_calls[0].arguments) == {"text": "a </tool_call> b"}


def test_parse_bad_json_keeps_raw_text(fmt):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    text = "Sure.\n" + _call("get_weather", {"city": "Paris"}) + "\n" + broken
    parsed = fmt.parse(text)
    assert parsed.content == text and parsed.tool_calls == []
    assert parsed.parse_error is not None and "tool call 2" in parsed.parse_error


def test_stream_filter_holds_back_markup(fmt):
    text = "Let me check.\n" + _call("get_weather", {"city": "Paris"})
    stream = _stream(fmt)
    emitted = "".join(stream.feed(ch)[1] for ch in text)
    assert emitted == "Let me check."
    result = stream.finish()
    assert result.content is None and result.parse_error is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris"}')]


def test_stream_filter_releases_lookalikes(fmt):
    text = "a < b and <tool is not <tool_call, ok <to"
    stream = _stream(fmt)
    emitted = "".join(stream.feed(text[i : i + 3])[1] for i in range(0, len(text), 3))
    result = stream.finish()
    assert emitted + (result.content or "") == text
    assert result.tool_calls == [] and result.parse_error is None


def test_stream_filter_bad_markup_returns_held_text(fmt):
    text = "Hi <tool_call>{not json"
    stream = _stream(fmt)
    _, emitted = stream.feed(text)
    result = stream.finish()
    assert emitted == "Hi" and result.content == " <tool_call>{not json"
    assert result.parse_error is not None and result.tool_calls == []


def test_native_template_gets_tools_passed_through(embedded_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    tokenizer.chat_template = NATIVE_TEMPLATE
    fmt = ChatFormatter(tokenizer)
    assert fmt.supports_tools_natively is True
    text = fmt.render(TOOL_TURNS, tools=[WEATHER_TOOL])
    assert text.startswith("TOOLS [")
    assert '"name": "get_weather"' in text and "# Tools" not in text
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments arrive as a dict
    assert "<|im_start|>tool\n18C<|im_end|>" in text


def test_new_tool_call_id():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("call_") and i[5:].isalnum() and len(i) == 29 for i in ids)


def test_parsed_turn_rerenders_as_generated(fmt):
    prompt = [{"role": "user", "content": "Weather in Paris?"}]
    completion = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = fmt.parse(completion)
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.tool_calls
    ]
    turn = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
    rendered = fmt.render([*prompt, turn], tools=[WEATHER_TOOL])
    assert fmt.render(prompt, tools=[WEATHER_TOOL]) + completion + "<|im_end|>" in rendered
