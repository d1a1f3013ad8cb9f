"""RULER: the embedded model as a real judge (constrained JSON), a scripted judge for the
retry and failure paths, scores mapped by id, the combination with a programmatic reward,
and a RULER-scored group training one GRPO step."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from art_integrations import (
    History,
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.rewards import (
    Judge,
    RulerError,
    combine_with_ruler,
    pop_ruler_failures,
    resolve_judge,
    ruler,
    ruler_score_group,
)
from tests.conftest import ServerThread, tiny_backend

Answer = Callable[[dict[str, Any]], str]


class StubJudge:
    """An OpenAI-compatible endpoint that answers as the test scripts it (one answer function
    per call, the last one repeating) and records every request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.script: list[Answer] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(body)
                answer = stub.script[min(len(stub.requests), len(stub.script)) - 1](body)
                payload = json.dumps({
                    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": answer}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.judge = Judge(base_url=self.base_url, model="stub-judge")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, *script: Answer) -> StubJudge:
        self.requests.clear()
        self.script = list(script)
        return self


@pytest.fixture(scope="module")
def stub() -> Iterator[StubJudge]:
    judge = StubJudge()
    yield judge
    judge.server.shutdown()
    judge.server.server_close()


def trajectories_in(request: dict[str, Any]) -> dict[str, str]:
    """id -> the rendered trajectory the judge was shown."""
    return dict(re.findall(r'<trajectory id="(t\d+)">\n(.*?)\n</trajectory>', request["messages"][1]["content"], re.S))


def scores(entries: list[tuple[str, float, str]]) -> str:
    return json.dumps({"scores": [{"trajectory_id": i, "score": s, "explanation": e} for i, s, e in entries]})


def by_content(request: dict[str, Any]) -> str:
    """0.9 to a trajectory that says Paris, 0.1 otherwise, listed in reverse order of the ids."""
    shown = trajectories_in(request)
    return scores([(i, 0.9 if "Paris" in body else 0.1, f"it says {body.splitlines()[0]}")
                   for i, body in reversed(shown.items())])


def by_id(request: dict[str, Any]) -> str:
    """Distinct scores in id order (0.1, 0.5, 0.9, ...), listed backwards."""
    ids = list(trajectories_in(request))
    return scores([(i, round(0.1 + 0.4 * n, 2), f"rank {n}") for n, i in reversed(list(enumerate(ids)))])


def capital_group(*answers: str) -> TrajectoryGroup:
    prompt = [{"role": "system", "content": "You answer geography questions."},
              {"role": "user", "content": "What is the capital of France?"}]
    return TrajectoryGroup(trajectories=[
        Trajectory(messages_and_choices=[*prompt, {"message": {"role": "assistant", "content": answer}}],
                   reward=float(n), metrics={"turns": 1}) for n, answer in enumerate(answers)],
        metadata={"scenario": "france"})


async def test_the_embedded_model_judges_a_group_by_id(server: ServerThread) -> None:
    group = capital_group("Lyon, I think.", "The capital of France is Paris.", "I don't know.",
                          "The capital of France is Paris.")
    judge = Judge(base_url=f"{server.base_url}/v1", model="SmolLM2-135M-Instruct", max_explanation_chars=40)
    scored = await ruler_score_group(group, judge)
    assert scored is group
    lyon, paris, unknown, paris_again = group.trajectories
    assert [t.metadata["ruler_id"] for t in group.trajectories] == ["t1", "t2", "t3", "t2"]
    for n, trajectory in enumerate(group.trajectories):
        assert 0 <= trajectory.reward <= 1 and trajectory.metrics["ruler_score"] == trajectory.reward
        assert trajectory.metrics["independent_reward"] == n and trajectory.metrics["turns"] == 1
        explanation = trajectory.metadata["ruler_explanation"]
        assert isinstance(explanation, str) and len(explanation) <= 40
        assert trajectory.logs[-1].startswith(f"RULER {trajectory.metadata['ruler_id']} (")
    assert paris.reward == paris_again.reward  # identical trajectories are judged once
    assert paris.metadata["ruler_explanation"] == paris_again.metadata["ruler_explanation"]


async def test_scores_follow_ids_not_positions_and_the_prompt_shares_the_prefix(stub: StubJudge) -> None:
    group = capital_group("Lyon.", "Paris.", "Paris.")
    group.trajectories[0].tools = [{"type": "function", "function": {"name": "atlas", "description": "Look up a city"}}]
    group.trajectories[0].additional_histories = [History(messages_and_choices=[
        {"role": "user", "content": "sub-task: list French cities"}, {"role": "assistant", "content": "Lyon, Nice"}])]
    assert await ruler_score_group(group, stub.answer(by_content).judge) is group
    lyon, paris, paris_again = group.trajectories
    assert (lyon.reward, paris.reward, paris_again.reward) == (0.1, 0.9, 0.9)
    explanations = {t.metadata["ruler_explanation"] for t in (paris, paris_again)}
    assert explanations == {"it says [assistant] Paris."}
    assert lyon.metadata["ruler_explanation"] == "it says [assistant] Lyon."
    assert lyon.metrics["independent_reward"] == 0.0 and paris_again.metrics["independent_reward"] == 2.0

    (request,) = stub.requests
    prompt = request["messages"][1]["content"]
    assert prompt.count("You answer geography questions.") == prompt.count("capital of France?") == 1
    assert "<tools>\n- atlas: Look up a city\n</tools>" in prompt
    assert trajectories_in(request) == {
        "t1": "[assistant] Lyon.\n--- sub-agent conversation 1 ---\n[user] sub-task: list French cities\n"
              "[assistant] Lyon, Nice",
        "t2": "[assistant] Paris."}
    schema = request["response_format"]["json_schema"]["schema"]["properties"]["scores"]
    assert schema["items"]["properties"]["trajectory_id"]["enum"] == ["t1", "t2"]
    assert schema["items"]["properties"]["score"] == {"type": "number", "minimum": 0, "maximum": 1}
    assert [item["properties"]["trajectory_id"]["enum"] for item in schema["prefixItems"]] == [["t1"], ["t2"]]
    assert request["temperature"] == 0


BAD_ANSWERS = {
    "missing id": (scores([("t1", 0.5, "ok")]), "no score for t2"),
    "out of range": (scores([("t1", 1.5, "great"), ("t2", 0.2, "meh")]), "score 1.5 of 't1' is outside [0, 1]"),
    "duplicate": (scores([("t1", 0.5, "a"), ("t1", 0.6, "b"), ("t2", 0.1, "c")]), "'t1' appears more than once"),
    "unknown id": (scores([("t1", 0.5, "a"), ("t2", 0.1, "b"), ("t3", 0.1, "c")]), "unknown trajectory_id 't3'"),
    "not json": ("Sure! Paris wins.", "not the requested JSON"),
}


@pytest.mark.parametrize("kind", BAD_ANSWERS)
async def test_one_retry_shows_the_judge_its_answer_and_the_error(stub: StubJudge, kind: str) -> None:
    bad, error = BAD_ANSWERS[kind]
    group = capital_group("Paris.", "Lyon.")
    await ruler_score_group(group, stub.answer(lambda _: bad, by_content).judge)
    assert [t.reward for t in group.trajectories] == [0.9, 0.1]
    first, retry = stub.requests
    assert retry["messages"][:2] == first["messages"]
    assert retry["messages"][2] == {"role": "assistant", "content": bad}
    assert error in retry["messages"][3]["content"]


async def test_a_judge_that_stays_wrong_raises_or_drops_the_group_with_the_reason(
        stub: StubJudge, caplog: pytest.LogCaptureFixture) -> None:
    pop_ruler_failures()
    always_bad = stub.answer(lambda _: scores([("t1", 2.0, "too good")])).judge
    expected = r"answered badly twice: score 2.0 of 't1' is outside \[0, 1\]; no score for t2"
    with pytest.raises(RulerError, match=expected):
        await ruler_score_group(capital_group("Paris.", "Lyon."), always_bad)
    assert len(stub.requests) == 2

    group = capital_group("Paris.", "Lyon.")
    with caplog.at_level(logging.WARNING, logger="art_integrations.rewards"):
        assert await ruler_score_group(group, always_bad, swallow_exceptions=True) is None
    assert "no score for t2" in group.metadata["ruler_error"] and "RULER dropped a group" in caplog.text
    assert all(t.logs[-1].startswith("RULER failed: RulerError") for t in group.trajectories)
    assert [t.reward for t in group.trajectories] == [0.0, 1.0]  # untouched
    (failure,) = pop_ruler_failures()
    assert failure.group_metadata["scenario"] == "france" and failure.trajectories == 2
    assert "no score for t2" in failure.error and pop_ruler_failures() == []


async def test_as_after_each_a_failed_group_is_dropped_and_the_others_kept(stub: StubJudge) -> None:
    def judge(request: dict[str, Any]) -> str:
        return "no idea" if "Rome" in request["messages"][1]["content"] else by_content(request)

    async def rollout(answer: str) -> Trajectory:
        return Trajectory(messages_and_choices=[{"role": "user", "content": "Capital?"},
                                                {"role": "assistant", "content": answer}])

    groups = await gather_trajectory_groups(
        [trajectory_group(lambda a=a: rollout(a), n=2, city=a) for a in ("Paris", "Rome")],
        after_each=ruler(stub.answer(judge).judge, swallow_exceptions=True), progress=False)
    assert [g.metadata["city"] for g in groups] == ["Paris"]
    assert [t.reward for t in groups[0].trajectories] == [0.9, 0.9]
    assert [f.group_metadata["city"] for f in pop_ruler_failures()] == ["Rome"]


async def test_judges_from_the_environment_a_client_or_nothing(stub: StubJudge, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("ART_JUDGE_BASE_URL", "ART_JUDGE_MODEL", "ART_JUDGE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RulerError, match="ART_JUDGE_BASE_URL.*ART_JUDGE_MODEL"):
        await ruler_score_group(capital_group("Paris.", "Lyon."))

    monkeypatch.setenv("ART_JUDGE_BASE_URL", stub.base_url)
    monkeypatch.setenv("ART_JUDGE_MODEL", "env-judge")
    stub.answer(by_content)
    group = await ruler_score_group(capital_group("Paris.", "Lyon."), debug=True)
    assert group is not None and [t.reward for t in group.trajectories] == [0.9, 0.1]
    assert stub.requests[0]["model"] == "env-judge"
    assert "t1 (trajectories [0]) score 0.900: it says [assistant] Paris." in capsys.readouterr().out

    client = AsyncOpenAI(base_url=stub.base_url, api_key="k")
    await ruler_score_group(capital_group("Lyon.", "Paris."), (client, "client-judge"))
    assert stub.requests[-1]["model"] == "client-judge"

    unreachable = Judge.from_client(AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="k", max_retries=0), "x")
    with pytest.raises(RulerError, match="The RULER judge 'x' at http://127.0.0.1:9/v1/ failed"):
        await ruler_score_group(capital_group("Paris.", "Lyon."), unreachable)


async def test_combine_with_ruler_keeps_both_parts(stub: StubJudge) -> None:
    group = capital_group("Paris.", "Lyon.")

    def short(trajectory: Trajectory) -> float:
        return 1.0 if len(trajectory.messages()[-1]["content"]) <= 5 else 0.0

    assert await combine_with_ruler(group, short, weight=0.25, judge=stub.answer(by_content).judge) is group
    paris, lyon = group.trajectories
    assert paris.metrics["programmatic_reward"] == 0.0 and paris.metrics["ruler_score"] == 0.9
    assert paris.reward == pytest.approx(0.25 * 0.0 + 0.75 * 0.9)
    assert lyon.reward == pytest.approx(0.25 * 1.0 + 0.75 * 0.1)
    with pytest.raises(ValueError, match="weight"):
        await combine_with_ruler(group, short, weight=2.0, judge=stub.judge)


async def test_a_ruler_scored_group_trains_one_grpo_step(stub: StubJudge, tmp_path: Path) -> None:
    async with tiny_backend(tmp_path) as backend:
        model = TrainableModel(name="judged", project="ruler")
        await model.register(backend)
        assert (await resolve_judge(model)).model == "tiny-random-smollm2" == (await resolve_judge(backend)).model
        client = model.openai_client()
        messages = [{"role": "user", "content": "Say something."}]
        group = TrajectoryGroup()
        for seed in range(3):
            response = await client.chat.completions.create(
                model=model.inference_name, messages=messages, max_tokens=6, logprobs=True, seed=seed,
                extra_body={"return_token_ids": True})
            trajectory = Trajectory(messages_and_choices=list(messages))
            trajectory.add_response(response)
            group.trajectories.append(trajectory)
        scored = await ruler_score_group(group, stub.answer(by_id).judge)
        assert scored is not None and sorted(t.reward for t in scored.trajectories) == [0.1, 0.5, 0.9]
        result = await model.train([scored], TrainConfig(learning_rate=1e-3))
    assert result.step == 1 and result.metrics["groups/trained"] == 1
    assert result.metrics["metrics/independent_reward"] == 0.0
