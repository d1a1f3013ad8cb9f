"""A single-turn RL script written the way ART's docs and wizard write one; only the imports
point at art_integrations. A prompted model (`art.Model`) is scored beside the trained one."""

import asyncio
import os

from openai import AsyncOpenAI

import art_integrations as art
from art_integrations.local import LocalBackend

BASE_MODEL = os.environ["BASE_MODEL"]
scenarios = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "Name a primary colour.", "answer": "red"}]


async def rollout(model: art.Model, scenario: dict) -> art.Trajectory:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": scenario["prompt"]}]
    response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                    temperature=0.9, max_completion_tokens=8)
    choice = response.choices[0]
    content = choice.message.content or ""
    reward = 1.0 if scenario["answer"] in content.lower() else len(content) % 7 / 7
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward, metrics={"acc": reward})


async def main() -> None:
    backend = LocalBackend()
    model = art.TrainableModel(name="single-001", project="art-port", base_model=BASE_MODEL)
    await model.register(backend)
    prompted = art.Model(name="prompted-base", project="art-port", inference_model_name=BASE_MODEL,
                         inference_base_url=model.inference_base_url, inference_api_key=model.inference_api_key)
    await prompted.register(backend)

    for step in range(await model.get_step(), 1):
        groups = [art.TrajectoryGroup(rollout(model, scenarios[(step + i) % len(scenarios)]) for _ in range(4))
                  for i in range(2)]
        finished_groups = await art.gather_trajectory_groups(groups, pbar_desc=f"step {step}")
        await model.delete_checkpoints()
        result = await model.train(finished_groups, config=art.TrainConfig(learning_rate=1e-4))
        print(f"trained step {result.step}")

    baseline = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(prompted, s) for _ in range(2)) for s in scenarios], pbar_desc="prompted")
    await prompted.log(baseline)
    print(f"Model: {model.get_inference_name()} step {await model.get_step()} at {model.openai_client().base_url}")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
