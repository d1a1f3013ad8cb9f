"""A multi-turn environment (game) loop written the way ART's docs and wizard write one, with
`iterate_dataset` and `@art.retry`; only the imports point at art_integrations."""

import asyncio
import os
import random

import openai
from openai import AsyncOpenAI

import art_integrations as art
from art_integrations.local import LocalBackend
from art_integrations.utils import iterate_dataset

BASE_MODEL = os.environ["BASE_MODEL"]
scenarios = [{"secret": n} for n in (3, 7, 9)]


class Game:
    def __init__(self, secret: int) -> None:
        self.secret, self.guesses, self.won = secret, 0, False

    def finished(self) -> bool:
        return self.won or self.guesses >= 3

    def observation(self) -> str:
        return f"Guess my number from 1 to 10. Guesses left: {3 - self.guesses}. Reply with a number."

    def apply(self, text: str) -> None:
        self.guesses += 1
        digits = "".join(c for c in text if c.isdigit())
        if not digits:
            raise ValueError("no number in the reply")
        self.won = int(digits[:2]) == self.secret


@art.retry(max_attempts=2, exceptions=(openai.APIConnectionError,))
async def rollout(model: art.Model, scenario: dict) -> art.Trajectory:
    client = AsyncOpenAI(base_url=model.inference_base_url, api_key=model.inference_api_key)
    game = Game(scenario["secret"])
    traj = art.Trajectory(messages_and_choices=[{"role": "system", "content": "You play a guessing game."}], reward=0.0)
    while not game.finished():
        traj.messages_and_choices.append({"role": "user", "content": game.observation()})
        response = await client.chat.completions.create(model=model.get_inference_name(), messages=traj.messages(),
                                                        temperature=1.0, max_completion_tokens=6)
        choice = response.choices[0]
        traj.messages_and_choices.append(choice)
        try:
            game.apply(choice.message.content or "")
        except ValueError:
            traj.reward = -1.0 + random.random() / 10  # an invalid move, told apart so the group has signal
            return traj
    traj.reward = 1.0 if game.won else 0.1 * game.guesses
    return traj


async def main() -> None:
    backend = LocalBackend()
    model = art.TrainableModel(name="game-001", project="art-port", base_model=BASE_MODEL)
    await model.register(backend)
    for batch in iterate_dataset(scenarios, groups_per_step=2, num_epochs=1, initial_step=await model.get_step()):
        if batch.step >= 1:
            break
        groups = [art.TrajectoryGroup(rollout(model, item) for _ in range(3)) for item in batch.items]
        finished_groups = await art.gather_trajectory_groups(groups, pbar_desc=f"epoch {batch.epoch} step {batch.step}")
        avg_reward = sum(t.reward for g in finished_groups for t in g.trajectories) / max(
            1, sum(len(g.trajectories) for g in finished_groups))
        print(f"Step {batch.step} (epoch {batch.epoch}): avg_reward={avg_reward:.3f}")
        await model.train(finished_groups, config=art.TrainConfig(learning_rate=1e-4))
    print(f"Model: {model.get_inference_name()} step {await model.get_step()}")
    await backend.close()


if __name__ == "__main__":
    asyncio.run(main())
