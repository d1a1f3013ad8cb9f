"""Coming from OpenPipe ART: scripts written the way ART's docs and wizard write them run with only
their imports pointing at us (one training step each on the tiny model); ART's names behave like
ART's; what we do not know is refused by name; trajectory data goes both ways with openpipe-art
itself (in its own venv, `make setup-art`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat.chat_completion import ChatCompletion

import art_integrations as art
from art_integrations.art_compat.format import to_art
from art_integrations.gather import TooManyRolloutErrors
from art_integrations.rewards.ruler import Judge, RulerError, resolve_judge
from tests.conftest import REPO, checkout_env

ART_PYTHON = REPO / ".venv-art" / "bin" / "python"
FIXTURES = REPO / "tests" / "fixtures"


# ----- ART's scripts, imports changed only ------------------------------------------------------

def _run_script(script: str, cwd: Path, tiny_model_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """Run one of tests/art_scripts/ on the tiny model, as a user runs it; it must succeed."""
    source = (REPO / "tests" / "art_scripts" / f"{script}.py").read_text()
    assert "art_integrations" in source and "import art\n" not in source and "from art." not in source
    cwd.mkdir(parents=True, exist_ok=True)
    run = subprocess.run([sys.executable, str(REPO / "tests" / "art_scripts" / f"{script}.py")], cwd=cwd,
                         env=checkout_env(ART_BACKEND_MODEL=str(tiny_model_dir), BASE_MODEL=tiny_model_dir.name, **env),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


@pytest.mark.parametrize("script", ["single_turn", "environment_loop", "tool_calls"])
def test_an_art_script_trains_a_step_with_only_its_imports_changed(script: str, tmp_path: Path, tiny_model_dir: Path,
                                                                   tiny_server: Any) -> None:
    run = _run_script(script, tmp_path, tiny_model_dir, JUDGE_MODEL=tiny_model_dir.name,
                      ART_JUDGE_BASE_URL=f"{tiny_server.base_url}/v1")  # RULER's judge: another endpoint, the tiny model
    assert "step 1" in run.stdout

    models = tmp_path / ".art" / "art-port" / "models"
    (trained,) = [d for d in models.iterdir() if (d / "checkpoints").is_dir()]
    history = [json.loads(line) for line in (trained / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if h["split"] == "train"] == [1]
    groups = [art.TrajectoryGroup.model_validate_json(line) for stored in (trained / "trajectories").glob("*/*.jsonl")
              for line in stored.read_text().splitlines()]  # trained on, and logged (a judge may drop every group)
    choices = [c for g in groups for t in g.trajectories for c in t.choices()]
    assert choices and all(c.token_ids and c.prompt_token_ids for c in choices)  # the appended openai choices
    if script == "single_turn":  # the prompted model's scores sit beside the trained model's
        logged = [json.loads(line) for line in (models / "prompted-base" / "history.jsonl").read_text().splitlines()]
        assert [(h["step"], h["split"], h["trajectories"]) for h in logged] == [(0, "val", 4)]
    if script == "tool_calls":  # the judge named by judge_model= was asked (the tiny model may fail as a judge)
        assert [h["split"] for h in history] == ["train", "val"]
        judged = int(run.stdout.split("judged ")[1].split()[0])
        assert judged == 2 or f"RULER judge {tiny_model_dir.name!r} at {tiny_server.base_url}/v1" in run.stderr


def test_a_game_loop_backed_up_to_s3_resumes_on_another_machine(tmp_path: Path, tiny_model_dir: Path,
                                                                 s3: str) -> None:
    """ART's game examples: pull from S3, register, train with _config, push; run again elsewhere."""
    first = _run_script("game_s3", tmp_path / "first", tiny_model_dir, BACKUP_BUCKET="games", TRAINING_STEPS="1")
    assert "trained step 1" in first.stdout and "ART_BACKEND_MAX_MODEL_LEN=8192" in first.stderr
    assert '"num_scheduler_steps": 1' in first.stderr  # named in the warning, as every engine setting asked for
    assert "logprob_calculation_chunk_size=8 is taken but changes nothing" in first.stderr
    second = _run_script("game_s3", tmp_path / "second", tiny_model_dir, BACKUP_BUCKET="games", TRAINING_STEPS="2")
    assert "pulled steps [1]" in second.stdout and "trained step 2" in second.stdout
    assert "trained step 1" not in second.stdout  # resumed at the pulled step
    pulled = tmp_path / "second" / ".art" / "nim" / "models" / "nim-001"
    assert sorted(p.name for p in (pulled / "checkpoints").iterdir()) == ["0001", "0002"]  # pruned before a step
    history = [json.loads(line) for line in (pulled / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if h["split"] == "train"] == [1, 2]


def test_a_validated_multi_group_loop_with_a_prompted_model_beside(tmp_path: Path, tiny_model_dir: Path,
                                                                   s3: str) -> None:
    """ART's email-agent example: a policy config, groups per step, val logged, a prompted model benchmarked."""
    run = _run_script("val_and_train", tmp_path, tiny_model_dir, BACKUP_BUCKET="email")
    assert "trained step 1" in run.stdout and "Training finished." in run.stdout
    models = tmp_path / ".art" / "email_agent" / "models"
    history = [json.loads(line) for line in (models / "email-agent-002" / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["split"]) for h in history] == [(0, "val"), (1, "train"), (1, "val")]
    assert next(h for h in history if h["split"] == "train")["groups/trained"] + \
        next(h for h in history if h["split"] == "train")["groups/skipped_zero_variance"] == 2
    prompted = [json.loads(line) for line in (models / "prompted-base" / "history.jsonl").read_text().splitlines()]
    assert [(h["step"], h["split"], h["trajectories"]) for h in prompted] == [(0, "val", 4)]


# ----- ART's names --------------------------------------------------------------------------------

def _trajectory(reward: float = 0.0) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=reward)


async def test_a_trajectory_group_of_awaitables_is_pending_until_gathered() -> None:
    async def rollout(reward: float) -> art.Trajectory:
        return _trajectory(reward)

    pending = art.TrajectoryGroup((rollout(r) for r in (0.0, 1.0)), metadata={"scenario": "a"})
    assert not isinstance(pending, art.TrajectoryGroup)
    group = await pending  # on its own, as in ART
    assert isinstance(group, art.TrajectoryGroup) and [t.reward for t in group] == [0.0, 1.0]
    assert group.metadata == {"scenario": "a"} and len(group) == 2

    gathered = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(r) for r in (0.5, 0.25))],
                                                  pbar_desc="ART style")
    assert [t.reward for t in gathered[0].trajectories] == [0.5, 0.25]

    mixed = art.TrajectoryGroup([_trajectory(1.0), ValueError("the tool broke")])
    assert len(mixed) == 1 and "ValueError: the tool broke" in mixed.exceptions[0]
    with pytest.raises(TypeError, match="not str"):
        art.TrajectoryGroup(["not a trajectory"])


async def test_after_each_may_split_a_group_as_in_art() -> None:
    async def rollout(reward: float) -> art.Trajectory:
        return _trajectory(reward)

    def split(group: art.TrajectoryGroup) -> list[art.TrajectoryGroup]:
        return [art.TrajectoryGroup([t]) for t in group.trajectories]

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup(rollout(r) for r in (0.0, 1.0))],
                                                after_each=split, progress=False)
    assert [[t.reward for t in g] for g in groups] == [[0.0], [1.0]]
    with pytest.raises(TypeError, match="after_each returned dict"):
        await art.gather_trajectory_groups([art.trajectory_group(lambda: rollout(1.0), n=1)],
                                           after_each=lambda group: {"oops": 1}, progress=False)


async def test_a_rollout_returning_no_trajectory_is_one_failed_rollout() -> None:
    async def forgetful(i: int) -> Any:
        return _trajectory(1.0) if i else None  # forgot `return trajectory` once

    groups = await art.gather_trajectory_groups([art.TrajectoryGroup(forgetful(i) for i in range(4))],
                                                max_exceptions=1, progress=False)
    assert len(groups[0].trajectories) == 3
    assert "a rollout returned NoneType, not a Trajectory" in groups[0].exceptions[0]
    with pytest.raises(TooManyRolloutErrors, match="returned NoneType"):
        await art.gather_trajectory_groups([art.trajectory_group(lambda: forgetful(0), n=2)], progress=False)


def _response(with_tokens: bool) -> ChatCompletion:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}
    body: dict[str, Any] = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}
    if with_tokens:
        choice.update(token_ids=[19, 2], prompt_token_ids=[1, 5, 7])
        body["prompt_token_ids"] = [1, 5, 7]
    return ChatCompletion.model_validate(body)


def test_an_appended_openai_choice_keeps_its_tokens_or_fails_at_once() -> None:
    messages = [{"role": "user", "content": "2 + 2?"}]
    trajectory = art.Trajectory(messages_and_choices=[*messages, _response(True).choices[0]])
    (choice,) = trajectory.choices()
    assert isinstance(choice, art.Choice) and choice.token_ids == [19, 2] and choice.prompt_token_ids == [1, 5, 7]

    appended = art.Trajectory(messages_and_choices=list(messages))
    appended.messages_and_choices.append(_response(True).choices[0])  # as ART's rollouts do, after construction
    assert appended.messages()[-1] == {"role": "assistant", "content": "4"}  # ready for the next request
    assert json.loads(appended.model_dump_json())["messages_and_choices"][-1]["token_ids"] == [19, 2]

    with pytest.raises(ValueError, match="return_token_ids"):
        art.Trajectory(messages_and_choices=[*messages, _response(False).choices[0]])
    late = art.Trajectory(messages_and_choices=list(messages))
    late.messages_and_choices.append(_response(False).choices[0])
    with pytest.raises(ValueError, match="carries no token ids"):
        late.messages()


@pytest.mark.parametrize(("build", "named", "hint"), [
    (lambda: art.TrainableModel(name="m", project="p", base_path="/tmp/x"), "base_path", "art_dir"),
    (lambda: art.Model(name="m", project="p", _internal_config={"engine_args": {}}), "_internal_config",
     "art-backend serve --help"),
    (lambda: art.TrainableModel(name="m", project="p", run_name="m-run-2"), "run_name", "under `name`"),
    (lambda: art.TrainConfig(optimizer_save_interval=5), "optimizer_save_interval", "backend.train()"),
    (lambda: art.TrainConfig(kl_penalty_coef=0.1), "kl_penalty_coef", "beta"),
    (lambda: art.TrainConfig(learning_rate=1e-5, loss_fn="ppo"), "loss_fn", "`loss`"),
    (lambda: art.Model(name="m", project="p", entity="me"), "entity", "WANDB_ENTITY"),
    (lambda: art.Trajectory(reward=1.0, rewards=2.0), "rewards", "Its fields: messages_and_choices"),
    (lambda: art.TrajectoryGroup(trajectories=[], metadate={}), "metadate", "Its fields: trajectories"),
    (lambda: art.LoraConfig(r=8), "'r'", "Its fields: rank"),
])
def test_what_is_not_known_is_refused_by_name(build: Any, named: str, hint: str) -> None:
    with pytest.raises(ValueError) as refused:
        build()
    assert named in str(refused.value) and hint in str(refused.value)


def test_art_names_without_a_counterpart_say_what_to_use() -> None:
    with pytest.raises(AttributeError, match="'tensorize' .*builds the training tensors"):
        art.tensorize  # noqa: B018 - the attribute access is the test
    with pytest.raises(AttributeError, match="capture_auto_trajectory.*art_capture"):
        art.capture_auto_trajectory  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Trajectroy'"):
        art.Trajectroy  # noqa: B018


async def test_backend_train_refuses_what_train_config_does_not_know(tmp_path: Path) -> None:
    async with art.LocalBackend(in_process=True, model="tiny-random-smollm2", art_dir=tmp_path) as backend:
        model = art.TrainableModel(name="refuses", project="compat")
        with pytest.raises(RuntimeError, match="not registered"):
            await backend.train(model, [], learning_rate=1e-4)
        await model.register(backend)
        assert model.inference_base_url == f"{backend.base_url}/v1" and model.inference_model_name == "refuses"
        with pytest.raises(ValueError, match="kl_penalty_coef.*beta"):
            await backend.train(model, [], kl_penalty_coef=0.1)
        with pytest.raises(TypeError, match="not both"):
            await backend.train(model, [], config=art.TrainConfig(), learning_rate=1e-4)
        with pytest.raises(ValueError, match="split/metric"):
            await model.delete_checkpoints(best_checkpoint_metric="reward")
        assert await model.delete_checkpoints(best_checkpoint_metric="val/reward") == {"deleted": [], "kept": []}
        prompted = art.Model(name="prompted", project="compat")
        await prompted.register(backend)
        with pytest.raises(art.BackendError, match="scored only"):  # the backend refuses too, not just the client
            await backend.request("POST", "/v1/training/models/compat/prompted/train", {"groups": []})


def test_iterate_dataset_walks_epochs_in_art_order_and_resumes() -> None:
    items = list(range(7))
    batches = list(art.iterate_dataset(items, groups_per_step=3, num_epochs=2, use_tqdm=False))
    assert [(b.step, b.epoch, b.epoch_step) for b in batches] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0),
                                                                    (4, 1, 1), (5, 1, 2)]
    for epoch in (0, 1):  # ART shuffles with random.seed(epoch): the same order, so a ported run resumes alike
        order = list(range(7))
        random.seed(epoch)
        random.shuffle(order)
        assert [i for b in batches if b.epoch == epoch for i in b.items] == order
    resumed = list(art.iterate_dataset(items, groups_per_step=3, num_epochs=2, initial_step=4, use_tqdm=False))
    assert resumed == batches[4:]
    with pytest.raises(ValueError, match="groups_per_step"):
        list(art.iterate_dataset(items, groups_per_step=0))


async def test_retry_backs_off_and_gives_up_with_the_last_error() -> None:
    calls: list[int] = []
    seen: list[tuple[str, int]] = []

    @art.retry(max_attempts=3, delay=0.01, exceptions=(ConnectionError,),
               on_retry=lambda error, attempt: seen.append((str(error), attempt)))
    async def flaky() -> int:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"try {len(calls)}")
        return len(calls)

    assert await flaky() == 3 and seen == [("try 1", 1), ("try 2", 2)]

    @art.retry(max_attempts=2, delay=0.0, exceptions=(ConnectionError,))
    def broken() -> None:
        raise ConnectionError("down")

    with pytest.raises(ConnectionError, match="down"):
        broken()

    @art.retry(exceptions=(ConnectionError,))
    async def wrong() -> None:
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        await wrong()


async def test_judge_model_names_a_judge_as_art_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ART_JUDGE_BASE_URL", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    judge = Judge.from_name("openai/o4-mini")
    assert (judge.model, judge.api_key) == ("o4-mini", "sk-test") and judge.base_url.endswith("/v1")
    monkeypatch.setenv("OPENROUTER_BASE_URL", "http://127.0.0.1:9/v1")
    assert Judge.from_name("openrouter/qwen/qwen3-8b").model == "qwen/qwen3-8b"
    with pytest.raises(RulerError, match="MYLAB_BASE_URL"):
        Judge.from_name("mylab/judge-7b")
    monkeypatch.setenv("ART_JUDGE_BASE_URL", "http://127.0.0.1:8000/v1")  # then the name is the endpoint's model
    assert (await resolve_judge("Qwen/Qwen3-8B")).model == "Qwen/Qwen3-8B"


# ----- the data, both ways, with openpipe-art itself ------------------------------------------------

_ART_SIDE = r'''
import json, sys
import art
from art.utils.trajectory_migration import dict_to_message_or_choice
from openai.types.chat.chat_completion import Choice

ours = [json.loads(line) for line in open(sys.argv[1])]
report = {"groups": 0, "choices": 0, "token_ids_match": 0}
for data in ours:
    trajectories = [art.Trajectory.model_validate(t) for t in data["trajectories"]]
    group = art.TrajectoryGroup(trajectories, metadata=data["metadata"], metrics=data["metrics"], logs=data["logs"])
    report["groups"] += 1
    for raw, trajectory in zip(data["trajectories"], group.trajectories):
        for history in [raw, *raw["additional_histories"]]:
            for item in history["messages_and_choices"]:
                if "message" not in item:
                    continue
                choice = dict_to_message_or_choice(item)  # how ART reads a stored choice back
                assert isinstance(choice, Choice), type(choice)
                read = [int(t.token.split(":")[1]) for t in choice.logprobs.content]  # as ART's tokenizer does
                report["choices"] += 1
                report["token_ids_match"] += read == item["token_ids"] == choice.model_extra["token_ids"]

choice = Choice.model_validate({"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"},
    "logprobs": {"content": [{"token": "token_id:%d" % i, "logprob": -0.5, "bytes": None, "top_logprobs": []}
                             for i in (17, 4)], "refusal": None}})
trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}, choice], reward=0.5,
                            initial_policy_version=3, final_policy_version=4, metrics={"turns": 1},
                            metadata={"scenario": "s1"}, logs=["started"])
theirs = art.TrajectoryGroup([trajectory, RuntimeError("rollout broke")], metrics={"judge_seconds": 1.5},
                             metadata={"split": "train"})
report["theirs"] = theirs.model_dump(mode="json")
print(json.dumps(report))
'''


@pytest.mark.skipif(not ART_PYTHON.exists(), reason="openpipe-art's venv is missing: `make setup-art` creates "
                    ".venv-art with openpipe-art 0.5.18 (`make test` does)")
def test_trajectory_data_round_trips_with_openpipe_art(tmp_path: Path) -> None:
    ours = [art.TrajectoryGroup.model_validate_json(line) for name in ("city_facts_step", "supervisor_step")
            for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]
    ours[0].exceptions.append("Traceback (most recent call last):\nTimeoutError: the tool timed out")
    exported = tmp_path / "ours.jsonl"
    exported.write_text("".join(json.dumps(to_art(group)) + "\n" for group in ours))
    run = subprocess.run([str(ART_PYTHON), "-c", _ART_SIDE, str(exported)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])

    our_choices = sum(len(h.choices()) for g in ours for t in g.trajectories for h in t.histories())
    assert report["groups"] == len(ours) and report["choices"] == our_choices > 0
    assert report["token_ids_match"] == our_choices  # every model turn's exact tokens, read the way ART reads them

    theirs = art.TrajectoryGroup.model_validate(report["theirs"])  # ART's JSON in ours: nothing dropped
    (trajectory,) = theirs.trajectories
    assert trajectory.choices()[0].token_ids == [17, 4]
    assert (trajectory.initial_policy_version, trajectory.final_policy_version) == (3, 4)
    assert theirs.metrics == {"judge_seconds": 1.5} and theirs.metadata == {"split": "train"}
    assert "rollout broke" in theirs.exceptions[0]
    with pytest.raises(ValueError, match="has no field 'start_time'"):  # a field we do not know: refused by name
        art.Trajectory.model_validate({**report["theirs"]["trajectories"][0], "start_time": "2026-11-25T00:00:00"})
