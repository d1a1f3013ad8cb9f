"""Smoke run: start the backend on the embedded model, ask for a tool call, print the reply
and its exact token ids.

    python examples/smoke.py

The backend runs as a child process on a free loopback port (`LocalBackend(in_process=False)`);
the request goes through the official `openai` SDK, with vLLM's `return_token_ids` extension.
"""

from __future__ import annotations

import asyncio
import json

from art_integrations import LocalBackend

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


async def main() -> None:
    print("Starting the backend (the first start converts the embedded model once)...")
    async with LocalBackend(in_process=False) as backend:
        client = backend.openai_client()
        model = (await client.models.list()).data[0].id
        response = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice="required",  # enforced by constrained decoding: always a well-formed call
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
        prompt_ids = response.model_extra["prompt_token_ids"]
        print(f"prompt_token_ids ({len(prompt_ids)}): {prompt_ids[:12]}...")
        print(f"completion token_ids ({len(choice.model_extra['token_ids'])}): {choice.model_extra['token_ids']}")
        print(f"logprobs: {len(choice.logprobs.content)} (one per completion token)")
        print(f"usage: {json.dumps(response.usage.model_dump())}")


if __name__ == "__main__":
    asyncio.run(main())
