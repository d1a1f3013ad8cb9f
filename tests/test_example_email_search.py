"""The email-search example: its inbox and search, the reward's parts, one tiny training step
(with the task's reward and with RULER), and the evaluation table."""

from __future__ import annotations

import json
import sqlite3
from typing import Any
from contextlib import closing
from pathlib import Path

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from pydantic import ValidationError

from examples.email_search.agent import TOOL_CHOICE_PER_CALL, inbox_tools
from examples.email_search.inbox import (
    database,
    generate_inbox,
    inbox_names,
    read,
    search,
)
from examples.email_search.rollout import episode_from
from examples.email_search.task import (
    MAX_MODEL_CALLS,
    Episode,
    Scenario,
    answer_is_right,
    scenarios,
    score,
)
from tests.conftest import run_example, training_server

# one tiny step, on a backend serving the tiny model (`--backend-url`)
STEP = ["--steps", "1", "--scenarios-per-step", "1", "--rollouts", "2", "--held-out", "2"]

# ---------------------------------------------------------------------------------------------
# the inbox


def test_inboxes_are_generated_from_their_name_and_every_question_is_answered_by_its_email() -> None:
    emails, questions = generate_inbox("train-3")
    assert (emails, questions) == generate_inbox("train-3")
    assert emails != generate_inbox("train-4")[0]
    assert len(emails) == 16 and len(questions) == 8  # 8 facts, 4 follow-ups without the fact, 4 newsletters
    by_id = {e.message_id: e for e in emails}
    assert len(by_id) == len(emails)
    for q in questions:
        assert q.answer in by_id[q.message_id].body
        # only the asked email carries the answer: the look-alikes do not
        assert [e.message_id for e in emails if q.answer in e.body] == [q.message_id]


def test_training_and_held_out_questions_come_from_different_inboxes() -> None:
    train, held_out = scenarios("train", 60, seed=0), scenarios("val", 12)
    assert {s.inbox for s in train} <= set(inbox_names("train"))
    assert {s.inbox for s in held_out} <= set(inbox_names("val"))
    assert not set(inbox_names("train")) & set(inbox_names("val"))
    assert held_out == scenarios("val", 12)  # the held-out set is fixed
    assert [s.question for s in scenarios("train", 5, seed=1)] != [s.question for s in train[:5]]
    assert len({(s.inbox, s.message_id) for s in train}) == 60  # no question repeats within a run


def test_the_database_holds_every_inbox_with_a_full_text_index() -> None:
    with closing(sqlite3.connect(database())) as db:
        emails = db.execute("SELECT count(*) FROM emails").fetchone()[0]
        indexed = db.execute("SELECT count(*) FROM emails_fts").fetchone()[0]
    assert emails == indexed == 16 * (len(inbox_names("train")) + len(inbox_names("val")))


def test_search_finds_the_fact_bearing_email_and_read_returns_it() -> None:
    question = next(q for q in generate_inbox("val-6")[1] if "Boston" in q.question)
    hits = search("val-6", "flight Boston")
    assert hits[0].message_id == question.message_id
    assert hits[0].subject == "Flight to Boston confirmed" and "Boston" in hits[0].snippet
    assert len(hits) <= 3
    # words are split as the index splits them, and any word may match
    assert search("val-6", "flight_to_Boston")[0].message_id == question.message_id
    assert question.message_id in {h.message_id for h in search("val-6", "boston zebra")}
    assert search("val-6", "zebra") == [] and search("val-6", " !! ") == []
    assert question.message_id not in {h.message_id for h in search("val-7", "flight Boston")}  # other inbox
    email = read("val-6", question.message_id)
    assert email is not None and question.answer in email.body
    assert read("val-6", "M00000") is None and read("val-7", question.message_id) is None


# ---------------------------------------------------------------------------------------------
# the tools and the agent


def test_the_tools_search_and_read_one_inbox_and_reject_malformed_ids() -> None:
    search_inbox, read_email, final_answer = inbox_tools("val-6")
    target = search("val-6", "flight Boston")[0].message_id
    assert search_inbox.invoke({"keywords": "flight Boston"}).startswith(f"message_id {target}: Flight to Boston")
    assert search_inbox.invoke({"keywords": "zebra"}) == "No emails found."
    assert "Boarding is at gate D7." in read_email.invoke({"message_id": target})
    assert read_email.invoke({"message_id": "M00000"}).startswith("No email has message_id 'M00000'")
    assert final_answer.invoke({"answer": "D7", "sources": [target]}) == "Answer sent."
    schema = read_email.tool_call_schema.model_json_schema()  # what the backend constrains the call to
    assert schema["properties"]["message_id"]["pattern"] == "^M[0-9]{5}$"
    # an id of the wrong shape is rejected (ToolNode then answers with an error ToolMessage,
    # which the reward counts as malformed)
    with pytest.raises(ValidationError, match="pattern"):
        read_email.invoke({"message_id": "gate D7"})
    call = AIMessage("", tool_calls=[{"name": "read_email", "args": {"message_id": "gate D7"}, "id": "c1"}])
    assert episode_from([call, ToolMessage("Error: ...", tool_call_id="c1", status="error")]).malformed == 1


def test_every_model_call_has_a_tool_choice_and_the_last_one_answers() -> None:
    assert len(TOOL_CHOICE_PER_CALL) == MAX_MODEL_CALLS
    assert TOOL_CHOICE_PER_CALL[0] == "search_inbox" and TOOL_CHOICE_PER_CALL[-1] == "return_final_answer"


def test_episode_from_reads_searches_reads_and_the_answer_off_the_messages() -> None:
    def call(name: str, args: dict, call_id: str) -> AIMessage:
        return AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id}])

    messages = [HumanMessage("Which gate?"),
                call("search_inbox", {"keywords": "gate"}, "a"), ToolMessage("...", tool_call_id="a"),
                call("read_email", {"message_id": "M12345"}, "b"), ToolMessage("...", tool_call_id="b"),
                call("return_final_answer", {"answer": "D7", "sources": ["M12345"]}, "c"),
                ToolMessage("Answer sent.", tool_call_id="c")]
    episode = episode_from(messages)
    assert episode == Episode(searches=["gate"], reads=["M12345"], answer="D7", sources=["M12345"], model_calls=3)
    # a reply without a tool call (an endpoint that ignores tool_choice) is malformed and ends the run
    episode = episode_from([HumanMessage("Which gate?"), AIMessage("Gate D7, I think.")])
    assert episode == Episode(model_calls=1, malformed=1)


# ---------------------------------------------------------------------------------------------
# the reward

SCENARIO = Scenario("val-0", "val-6", "Which gate does my flight to Boston leave from?", "D7",
                    search("val-6", "flight Boston")[0].message_id)
OTHER = search("val-6", "flight Boston")[1].message_id  # another flight's email in the same inbox


def perfect(**changes: object) -> Episode:
    fields = {"searches": ["flight Boston"], "reads": [SCENARIO.message_id], "answer": "Gate D7",
              "sources": [SCENARIO.message_id], "model_calls": 3, **changes}
    return Episode(**fields)  # type: ignore[arg-type]


def test_a_perfect_episode_scores_one_and_every_part_shows() -> None:
    parts = score(SCENARIO, perfect())
    assert parts == {"answer_right": 1.0, "answer_overlap": 1.0, "cited_source": 1.0, "found_email": 1.0,
                     "read_email": 1.0, "fewer_calls": 1.0, "unknown_ids": 0.0, "malformed": 0.0,
                     "model_calls": 3.0, "reward": pytest.approx(1.0)}


def test_partial_credit_for_each_part() -> None:
    assert score(SCENARIO, perfect(model_calls=4))["reward"] == pytest.approx(0.95)  # the spare call costs the bonus
    assert score(SCENARIO, perfect(sources=[OTHER]))["reward"] == pytest.approx(0.85)  # cited the wrong email
    assert score(SCENARIO, perfect(reads=[OTHER]))["reward"] == pytest.approx(0.9)  # answered from the snippet
    # a wrong answer keeps the search, read and citation credit, and gets no bonus for being quick
    wrong = score(SCENARIO, perfect(answer="Gate B11"))
    assert wrong["reward"] == pytest.approx(0.35) and wrong["fewer_calls"] == 0.0
    # searching with words that miss the email loses that part
    assert score(SCENARIO, perfect(searches=["zebra"]))["found_email"] == 0.0
    # part of a multi-word answer earns part of the overlap credit
    time = Scenario("x", "val-6", "When?", "3:30 PM", SCENARIO.message_id)
    assert score(time, perfect(answer="at 3:30"))["answer_overlap"] == pytest.approx(2 / 3)


def test_answers_match_ignoring_case_spaces_and_punctuation() -> None:
    assert answer_is_right("$59.49", "It cost 59.49 dollars")
    assert answer_is_right("INV-2453", "invoice inv 2453")
    assert answer_is_right("3:30 PM", "The meeting starts at 3:30pm.")
    assert not answer_is_right("3:30 PM", "3:30 AM")
    assert not answer_is_right("D7", "gate D17")


def test_made_up_ids_and_malformed_steps_are_penalised() -> None:
    made_up = score(SCENARIO, perfect(reads=["M00000"], sources=["M00000", "M11111", "M22222"]))
    assert made_up["unknown_ids"] == 3.0
    assert made_up["reward"] == pytest.approx(1.0 - 0.1 - 0.15 - 0.1)  # no read, no citation, penalty capped at 2 ids
    assert score(SCENARIO, perfect(malformed=1))["reward"] == pytest.approx(0.95)
    no_answer = score(SCENARIO, perfect(answer=None, sources=[]))
    assert no_answer["malformed"] == 1.0 and no_answer["reward"] == pytest.approx(0.2 - 0.05)
    # the reward never goes below zero
    assert score(SCENARIO, Episode(searches=["zebra"], reads=["M00000"], model_calls=1, malformed=2))["reward"] == 0.0


# ---------------------------------------------------------------------------------------------
# the commands


def test_train_runs_a_tiny_step_and_evaluate_prints_the_table(tmp_path: Path, tiny_engine: Any) -> None:
    with training_server(tiny_engine, tmp_path) as backend:  # the job against `art-backend serve`
        out = run_example("examples.email_search.train", *STEP, "--art-dir", str(tmp_path), "--backend-url",
                          backend.base_url)
        table = run_example("examples.email_search.evaluate", "--backend-url", backend.base_url, "--art-dir",
                            str(tmp_path), "--held-out", "2", "--models", "tiny-random-smollm2", "email-agent-s0")
    assert "base model held-out score (step 0): " in out
    assert "step 1/1:" in out  # the batch trained, or skipped when its rewards were all equal
    assert "answer_right" in out and "cited_source" in out
    assert "held-out score: base" in out
    model_dir = tmp_path / "email-search" / "models" / "email-agent-s0"
    assert (model_dir / "learning_curve.png").stat().st_size > 1000
    assert (model_dir / "history.jsonl").is_file()
    header, *rows = table.strip().splitlines()
    assert header.split()[:3] == ["model", "held-out", "score"] and "read_email" in header
    assert [row.split()[0] for row in rows] == ["tiny-random-smollm2", "email-agent-s0"]
    assert all(0.0 <= float(value) <= 1.0 for row in rows for value in row.split()[1:])


def test_train_with_ruler_scores_or_drops_each_group(tmp_path: Path, tiny_engine: Any) -> None:
    # The tiny random model is a hopeless judge: its answer is cut off or invalid, and the group
    # is dropped (the reason goes to the log); should it ever answer, the step trains on RULER's
    # scores with the task's reward kept as metrics/independent_reward (unless it scored both alike).
    with training_server(tiny_engine, tmp_path) as backend:  # the judge: the backend's own base model
        out = run_example("examples.email_search.train", *STEP, "--art-dir", str(tmp_path), "--ruler",
                          "--backend-url", backend.base_url)
    step = next(line for line in out.splitlines() if line.startswith("step "))
    model_dir = tmp_path / "email-search" / "models" / "email-agent-s0"
    untrained = [r for r in map(json.loads, (model_dir / "history.jsonl").read_text().splitlines())
                 if r["split"] == "train" and r["trained"] is False]
    # nothing to train is still a step: recorded, its checkpoint the unchanged adapter
    if "(1 dropped)" in step:
        assert "reward mean n/a" in step and "groups trained 0/1" in step
        assert [r["step"] for r in untrained] == [1] and (model_dir / "checkpoints" / "0001").is_dir()
    elif "groups trained 0/1" in step:  # judged, but both rollouts alike: no signal, nothing trained
        assert " std 0.000," in step
        assert [r["step"] for r in untrained] == [1] and (model_dir / "checkpoints" / "0001").is_dir()
    else:
        assert "metrics/independent_reward" in (model_dir / "history.jsonl").read_text()
    assert "held-out score: base" in out


def test_the_experts_demonstrations_do_the_job_with_the_agents_tools() -> None:
    """Each demonstration is the agent's conversation done right: the task's own reward gives it
    full marks, read back from its messages as the rollouts' are."""
    from langchain_core.messages import convert_to_messages

    from examples.email_search.agent import SYSTEM_PROMPT
    from examples.email_search.expert import demonstrations

    picked = scenarios("train", 24, 7)
    for scenario, demonstration in zip(picked, demonstrations(picked)):
        messages = demonstration.messages_and_choices
        assert messages[0] == {"role": "system", "content": SYSTEM_PROMPT}
        assert [t["function"]["name"] for t in demonstration.tools or []] == [
            t.name for t in inbox_tools(scenario.inbox)]
        episode = episode_from(convert_to_messages(messages[1:]))
        assert score(scenario, episode)["reward"] == 1.0, (scenario, episode)


def test_an_sft_warm_start_trains_the_demonstrations_then_the_grpo_steps(tmp_path: Path, tiny_engine: Any) -> None:
    with training_server(tiny_engine, tmp_path) as backend:
        out = run_example("examples.email_search.train", *STEP, "--sft-demos", "2", "--art-dir", str(tmp_path),
                          "--backend-url", backend.base_url)
    assert "SFT step 1: 2 demonstrations x 2 epochs" in out
    assert "after SFT held-out score (step 1): " in out and "step 1/1:" in out
    assert "trained policy held-out score (step 2): " in out
    assert " -> after SFT " in out.split("held-out score: base", 1)[1].splitlines()[0]
    history = [json.loads(line) for line in
               (tmp_path / "email-search" / "models" / "email-agent-s0" / "history.jsonl").read_text().splitlines()]
    sft = next(r for r in history if r.get("kind") == "sft")
    # the expert's messages carry no token ids: rendered with the served model's template, as serving would
    assert (sft["step"], sft["trajectories"], sft["histories/rendered"]) == (1, 4, 4)
    assert [r["step"] for r in history if r["split"] == "train"] == [1, 2]


def test_a_negative_demonstration_count_is_refused_by_name() -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "examples.email_search.train", "--sft-demos", "-2"],
                            capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 2 and "--sft-demos -2" in result.stderr and "counted from 0" in result.stderr
