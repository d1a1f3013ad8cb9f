"""Where SFT data comes from besides a file: a teacher's calls recorded by `art_capture(teacher=True)`
(any OpenAI-compatible server that is not an art-backend, here the tiny model behind one without
the backend's mark), as messages without token ids, beside the policy's exact ones, and trained
with `train_sft`; and rejection sampling's data, each scored group's best (`best_of_groups`)."""

from __future__ import annotations

import openai
import pytest

from art_integrations import RemoteBackend, TrainableModel, Trajectory, TrajectoryGroup, art_capture
from art_integrations.trajectory import Choice
from art_integrations.utils.sft import best_of_groups
from tests.conftest import ServerThread

MODEL = "tiny-random-smollm2"
QUESTION = [{"role": "user", "content": "Name a color."}]


def _ask(server: ServerThread, messages: list[dict[str, str]] = QUESTION) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    return reply.choices[0].message.content or ""


async def test_a_teachers_calls_are_recorded_as_messages_only_when_asked(other_server: ServerThread,
                                                                         tiny_server: ServerThread) -> None:
    async with art_capture() as judged:  # the default: another server (a judge) stays out
        _ask(other_server)
    assert judged.metrics["model_calls"] == 0
    async with art_capture(teacher=True) as taught:
        answer = _ask(other_server)
        _ask(tiny_server)  # the policy's call, beside it, keeps its exact tokens
    assert not taught.logs, taught.logs
    assert taught.metrics["model_calls"] == 2
    teacher, policy = taught.histories()
    assert teacher.messages_and_choices == [*QUESTION, {"role": "assistant", "content": answer}]
    assert not teacher.choices()  # a message, not a Choice: no token ids that are not the policy's
    (choice,) = policy.choices()
    assert isinstance(choice, Choice) and choice.token_ids and choice.prompt_token_ids


def test_teacher_takes_only_a_bool() -> None:
    with pytest.raises(TypeError, match=r"teacher='yes'.*True or False"):
        art_capture(teacher="yes")  # type: ignore[arg-type]


async def test_a_teachers_conversation_trains_an_sft_step(other_server: ServerThread,
                                                          tiny_training_server: ServerThread) -> None:
    async with art_capture(teacher=True) as taught:
        first = _ask(other_server)
        _ask(other_server, [*QUESTION, {"role": "assistant", "content": first},
                            {"role": "user", "content": "Another one."}])
    assert [len(h.messages_and_choices) for h in taught.histories()] == [4]  # one conversation, continued
    backend = RemoteBackend(tiny_training_server.base_url)
    model = TrainableModel(name="taught", project="sft-teacher")
    await model.register(backend)
    result = await model.train_sft([taught])
    assert result.step == 1 and result.metrics["trajectories"] == 1
    await backend.close()


def _group(*rewards: float) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[*QUESTION, {"role": "assistant",
                                                                                      "content": str(i)}], reward=r)
                                         for i, r in enumerate(rewards)])


def test_best_of_groups_takes_each_groups_best_that_is_better_or_good_enough() -> None:
    groups = [_group(0.2, 0.9, 0.9), _group(0.5, 0.5), _group(0.0, 0.1), _group(1.0, 1.0)]
    assert [t.messages()[-1]["content"] for t in best_of_groups(groups)] == ["1", "1"]  # ties: the first
    assert [t.reward for t in best_of_groups(groups, min_reward=0.5)] == [0.9, 0.5, 1.0]
    assert best_of_groups([TrajectoryGroup(trajectories=[])]) == []
    with pytest.raises(TypeError, match="TrajectoryGroup objects, not Trajectory"):
        best_of_groups([Trajectory()])  # type: ignore[list-item]
