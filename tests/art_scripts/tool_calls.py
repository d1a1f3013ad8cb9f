"""A tool-calling loop scored with RULER, written the way ART's docs and wizard write one, trained
with ART's current call (`backend.train(model, groups, learning_rate=...)`); only the imports
point at art_integrations. The judge is any OpenAI-compatible endpoint (ART_JUDGE_BASE_URL)."""

import asyncio
import json
import os

from openai import AsyncOpenAI

import art_integrations as art
from art_integrations.local import LocalBackend
from art_integrations.rewards import ruler_score_group

BASE_MODEL = os.environ["BASE_MODEL"]
JUDGE_MODEL = os.environ["JUDGE_MODEL"]
MAX_TURNS = 2
scenarios = [{"task": "What is the weather in Paris?"}, {"task": "What is the weather in Oslo?"}]
tools = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def execute_tool(name: str, args: dict) -> str:
    return f"Sunny in {args.get('city', 'nowhere')}" if name == "get_weather" else f"unknown tool {name}"


async def rollout(model: art.Model, scenario: dict) -> art.Trajectory:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    traj = art.Trajectory(messages_and_choices=[{"role": "user", "content": scenario["task"]}], tools=tools,
                          reward=0.0)
    for _turn in range(MAX_TURNS):
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=traj.messages(),
                                                        tools=tools, temperature=0.9, max_completion_tokens=24)
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        if not choice.message.tool_calls:
            break
        for tc in choice.message.tool_calls:
            result = execute_tool(tc.function.name, json.loads(tc.function.arguments))
            traj.messages_and_choices.append({"role": "tool", "tool_call_id": tc.id, "content": str(result)})
    return traj


async def main() -> None:
    backend = LocalBackend()
    model = art.TrainableModel(name="tools-001", project="art-port", base_model=BASE_MODEL)
    await model.register(backend)
    for step in range(await model.get_step(), 1):
        groups = [art.TrajectoryGroup(rollout(model, scenario) for _ in range(3)) for scenario in scenarios]
        finished_groups = await art.gather_trajectory_groups(groups, pbar_desc=f"step {step}")
        judged_groups = []
        for group in finished_groups:
            judged = await ruler_score_group(group, judge_model=JUDGE_MODEL, swallow_exceptions=True)
            if judged is not None:
                judged_groups.append(judged)
        print(f"judged {len(judged_groups)} of {len(finished_groups)} groups")
        result = await backend.train(model, judged_groups, learning_rate=1e-4)
        print(f"trained step {result.step}")
    validation = await art.gather_trajectories((rollout(model, s) for s in scenarios), pbar_desc="val")
    await model.log([art.TrajectoryGroup(validation)], split="val")
    print(f"Model: {model.get_inference_name()} step {await model.get_step()}")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
