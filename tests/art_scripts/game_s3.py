"""A game loop written the way OpenPipe's published game examples (2048, tic-tac-toe) are written:
`_internal_config` for a small GPU, the run pulled from S3 before registering and pushed after
each step, `_config` on train. Only the imports and the scale (model, steps, rollouts) changed."""

import asyncio
import os
import random

from openai import AsyncOpenAI

import art_integrations as art
from art_integrations.local import LocalBackend

BASE_MODEL = os.environ["BASE_MODEL"]
TRAINING_STEPS = int(os.environ["TRAINING_STEPS"])
random.seed(42)

# Declare the model
model = art.TrainableModel(name="nim-001", project="nim", base_model=BASE_MODEL)
# To run on a T4, we need to override some config defaults.
model._internal_config = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(max_seq_length=8192),
    engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8, num_scheduler_steps=1),
)


async def rollout(model: art.Model, step: int) -> art.Trajectory:
    """Nim: take 1 or 2 stones; whoever takes the last one wins. The opponent plays at random."""
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    stones = 5
    trajectory = art.Trajectory(
        messages_and_choices=[{"role": "system", "content": "You play Nim. Reply with 1 or 2."}],
        reward=0.0, metrics={"step": step})
    while stones > 0:
        trajectory.messages_and_choices.append({"role": "user", "content": f"{stones} stones left. Take 1 or 2."})
        response = await client.chat.completions.create(model=model.get_inference_name(),
                                                        messages=trajectory.messages(), max_completion_tokens=4)
        choice = response.choices[0]
        trajectory.messages_and_choices.append(choice)
        move = next((c for c in choice.message.content or "" if c in "12"), None)
        if move is None:
            trajectory.reward = -1.0 + random.random() / 10  # an invalid move
            return trajectory
        stones -= min(int(move), stones)
        if stones == 0:
            trajectory.reward = 1.0
            return trajectory
        stones -= min(random.choice([1, 2]), stones)
    trajectory.reward = 0.0
    return trajectory


async def main() -> None:
    # Initialize the server
    backend = LocalBackend()

    print(f"Pulling from S3 bucket: `{os.environ['BACKUP_BUCKET']}`")
    await backend._experimental_pull_from_s3(model, verbose=True)

    # Register the model with the local backend (sets up logging, inference, and training)
    await model.register(backend)

    for i in range(await model.get_step(), TRAINING_STEPS):
        train_groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, i) for _ in range(4)) for _ in range(1)),
            pbar_desc="gather",
            max_exceptions=2,
        )
        await model.delete_checkpoints()
        result = await model.train(
            train_groups,
            config=art.TrainConfig(learning_rate=3e-5),
            # Lowering the logprob_calculation_chunk_size is a memory saving measure
            # to allow longer sequences (up to 4096 tokens) to be processed on a T4.
            _config={"logprob_calculation_chunk_size": 8},
        )
        print(f"trained step {result.step}")
        await backend._experimental_push_to_s3(model)
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
