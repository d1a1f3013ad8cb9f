"""Smoke run: start the backend on the embedded model, ask for a tool call, print the reply
and its exact token ids.

    python examples/smoke.py

The backend runs as a child process on a free loopback port; the request goes through the
official `openai` SDK, with vLLM's `return_token_ids` extension.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


# One worked example in the history: the 135M model then answers with a well-formed call.
CONVERSATION = [
    {"role": "user", "content": "What is the weather in London?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "London"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, cloudy"},
    {"role": "assistant", "content": "It is 12 C and cloudy in London."},
    {"role": "user", "content": "What is the weather in Paris?"},
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(base_url: str, server: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"The backend exited with code {server.returncode}; see its log above.")
        try:
            if httpx.get(f"{base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    sys.exit(f"The backend did not answer within {timeout:.0f} s.")


def main() -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    print(f"Starting the backend on {base_url} (the first start converts the embedded model once)...")
    server = subprocess.Popen([sys.executable, "-m", "art_backend", "serve", "--port", str(port)])
    try:
        wait_until_up(base_url, server)
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused")
        model = client.models.list().data[0].id
        response = client.chat.completions.create(
            model=model,
            messages=CONVERSATION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=48,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        choice = response.choices[0]
        print(f"\nmodel: {model}")
        print(f"finish_reason: {choice.finish_reason}")
        print(f"content: {choice.message.content!r}")
        for call in choice.message.tool_calls or []:
            print(f"tool call: {call.function.name}({call.function.arguments})  id={call.id}")
        if choice.model_extra.get("tool_call_parse_error"):
            print(f"tool-call markup did not parse: {choice.model_extra['tool_call_parse_error']}")
        print(f"prompt_token_ids ({len(response.model_extra['prompt_token_ids'])}): "
              f"{response.model_extra['prompt_token_ids'][:12]}...")
        print(f"completion token_ids ({len(choice.model_extra['token_ids'])}): {choice.model_extra['token_ids']}")
        print(f"logprobs: {len(choice.logprobs.content)} (one per completion token)")
        print(f"usage: {json.dumps(response.usage.model_dump())}")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
