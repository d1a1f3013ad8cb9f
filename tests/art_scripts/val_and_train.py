"""A training loop written the way OpenPipe's published email-agent example is written: a policy
config on the model, several groups per step from `iterate_dataset`, a validation split logged
every `eval_steps` beside a prompted `art.Model` benchmarked on the same scenarios, the run backed
up to S3. Only the imports and the scale (model, data, steps, rollouts) changed."""

import asyncio
import os

from openai import AsyncOpenAI
from pydantic import BaseModel

import art_integrations as art
from art_integrations.local import LocalBackend
from art_integrations.utils import iterate_dataset

BASE_MODEL = os.environ["BASE_MODEL"]


class TrainingConfig(BaseModel):
    trajectories_per_group: int = 3
    groups_per_step: int = 2
    learning_rate: float = 1.2e-5
    eval_steps: int = 1
    num_epochs: int = 1


class ProjectPolicyConfig(BaseModel):
    max_tokens: int = 8
    training_config: TrainingConfig | None = None


agent_002 = art.TrainableModel(
    name="email-agent-002",
    project="email_agent",
    base_model=BASE_MODEL,
    config=ProjectPolicyConfig(training_config=TrainingConfig()),
)
questions = [{"q": "Which day is the meeting?", "a": "monday"}, {"q": "Who sent the invoice?", "a": "bob"},
             {"q": "What is the project code?", "a": "x7"}, {"q": "Where is the offsite?", "a": "paris"}]
val_questions = questions[:2]


async def rollout(model: art.Model, scenario: dict) -> art.Trajectory:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    messages = [{"role": "system", "content": "Answer from the inbox in one word."},
                {"role": "user", "content": scenario["q"]}]
    max_tokens = model.config.max_tokens if isinstance(model.config, ProjectPolicyConfig) else 8
    response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                    max_completion_tokens=max_tokens)
    choice = response.choices[0]
    answer = (choice.message.content or "").lower()
    correct = scenario["a"] in answer
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=1.0 if correct else len(answer) % 5 / 10,
                          metrics={"correct": correct})


async def benchmark_model(model: art.Model) -> None:
    groups = await art.gather_trajectory_groups(
        (art.TrajectoryGroup(rollout(model, scenario) for _ in range(2)) for scenario in val_questions),
        pbar_desc=f"gather {model.name}", max_exceptions=1)
    await model.log(groups, split="val")


async def run_training(model: art.TrainableModel) -> None:
    assert model.config.training_config is not None
    backend = LocalBackend()
    print(f"Pulling from S3 bucket: `{os.environ['BACKUP_BUCKET']}`")
    await backend._experimental_pull_from_s3(model, s3_bucket=os.environ["BACKUP_BUCKET"], verbose=True)
    await model.register(backend)

    prompted = art.Model(name="prompted-base", project="email_agent", inference_model_name=BASE_MODEL,
                         inference_base_url=model.inference_base_url, inference_api_key=model.inference_api_key)
    await prompted.register(backend)
    await benchmark_model(prompted)

    train_iterator = iterate_dataset(questions, groups_per_step=model.config.training_config.groups_per_step,
                                     num_epochs=model.config.training_config.num_epochs,
                                     initial_step=await model.get_step())
    for batch in train_iterator:
        if batch.step >= 1:  # one step at this scale
            break
        if batch.step % model.config.training_config.eval_steps == 0:
            print(f"\n--- Evaluating at Iteration {batch.step} ---")
            await benchmark_model(model)
            await model.delete_checkpoints()
            await backend._experimental_push_to_s3(model, s3_bucket=os.environ["BACKUP_BUCKET"])
        groups = await art.gather_trajectory_groups(
            art.TrajectoryGroup(rollout(model, scenario)
                                for _ in range(model.config.training_config.trajectories_per_group))
            for scenario in batch.items)
        result = await model.train(groups, config=art.TrainConfig(
            learning_rate=model.config.training_config.learning_rate))
        print(f"trained step {result.step}")
    await benchmark_model(model)
    await backend._experimental_push_to_s3(model, s3_bucket=os.environ["BACKUP_BUCKET"])
    print("Training finished.")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(run_training(agent_002))
