"""Langfuse export, checked against a local receiver of what the SDK sends (OTLP/HTTP span
batches and score batches): a LangGraph agent gathered live with RULER scores, trained, and
its stored trajectories exported again afterwards by the command; sub-agents and branches;
Langfuse's own LangChain handler in the same run; refused uploads; a missing SDK or keys."""

from __future__ import annotations

import base64
import gzip
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import redirect_stdout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from pathlib import Path
from typing import Any, Literal

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import MessagesState
from langgraph.prebuilt import create_react_agent
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from art_integrations import (
    TrainableModel,
    TrainConfig,
    Trajectory,
    TrajectoryGroup,
    art_capture,
    gather_trajectory_groups,
    trajectory_group,
)
from art_integrations.langchain import ARTCallbackHandler, ChatART
from art_integrations.observability import LangfuseExporter, TraceLabels
from art_integrations.rewards import Judge, ruler
from art_integrations.trajectory import Choice
from tests.conftest import checkout_env, ServerThread, supervisor_graph, tiny_backend

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning",
                                        "ignore:create_react_agent has been moved")

PUBLIC_KEY, SECRET_KEY = "pk-lf-test", "sk-lf-test"
ROOT = Path(__file__).resolve().parent.parent


# ----- what a Langfuse server would receive --------------------------------------------------


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class Span:
    trace: str
    id: str
    parent: str
    name: str
    attributes: dict[str, Any]

    def _json(self, key: str) -> Any:
        if key not in self.attributes:
            return None
        try:
            return json.loads(self.attributes[key])
        except ValueError:  # the SDK sends a string as it is
            return self.attributes[key]

    @property
    def type(self) -> str:
        return self.attributes.get("langfuse.observation.type", "")

    @property
    def input(self) -> Any:
        return self._json("langfuse.observation.input")

    @property
    def output(self) -> Any:
        return self._json("langfuse.observation.output")

    @property
    def model(self) -> str | None:
        return self.attributes.get("langfuse.observation.model.name")

    @property
    def usage(self) -> Any:
        return self._json("langfuse.observation.usage_details")

    def metadata(self, key: str) -> Any:
        return self._json(f"langfuse.observation.metadata.{key}")

    @property
    def tags(self) -> list[str]:
        return self.attributes.get("langfuse.trace.tags", [])

    @property
    def trace_metadata(self) -> dict[str, Any]:
        prefix = "langfuse.trace.metadata."
        return {k[len(prefix):]: json.loads(v) for k, v in self.attributes.items() if k.startswith(prefix)}


class LangfuseReceiver:
    """A loopback stand-in for a Langfuse server: OTLP/HTTP spans, score batches, and any other
    request recorded as unexpected. `refuse` answers 400 to everything (a rejected upload)."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.scores: list[dict[str, Any]] = []
        self.unexpected: list[str] = []
        self.authorizations: set[str] = set()
        self.refuse = False
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._lock:
                    receiver.authorizations.add(self.headers.get("Authorization", ""))
                    status, kind, payload = receiver.answer(self.path, body)
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST  # noqa: N815 - whatever else the SDK asks for is recorded as unexpected

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        if self.refuse:
            return 400, "application/json", b'{"message": "refused by the test"}'
        if path == "/api/public/otel/v1/traces":
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
                for scope in resource.scope_spans:
                    self.spans += [Span(s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name,
                                        {a.key: _value(a.value) for a in s.attributes}) for s in scope.spans]
            return 200, "application/x-protobuf", ExportTraceServiceResponse().SerializeToString()
        if path == "/api/public/scores":
            self.scores += json.loads(body)
            return 202, "application/json", b'{"message": "Accepted"}'
        self.unexpected.append(path)
        return 404, "application/json", b"{}"

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace == trace_id]

    def root(self, trace_id: str) -> Span:
        spans = self.trace(trace_id)
        ids = {s.id for s in spans}
        (root,) = [s for s in spans if s.parent not in ids]
        return root

    def children(self, span: Span) -> list[Span]:
        return [s for s in self.spans if s.parent == span.id and s.trace == span.trace]  # in the order they ended

    def scores_of(self, trace_id: str) -> dict[str, dict[str, Any]]:
        return {s["name"]: s for s in self.scores if s.get("traceId") == trace_id}

    def traces_tagged(self, *tags: str) -> list[str]:
        roots = [s for s in self.spans if s.name == "rollout" and set(tags) <= set(s.tags)]
        return [s.trace for s in roots]


@pytest.fixture(scope="module")
def receiver() -> Iterator[LangfuseReceiver]:
    running = LangfuseReceiver()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LANGFUSE_PUBLIC_KEY", PUBLIC_KEY)
        env.setenv("LANGFUSE_SECRET_KEY", SECRET_KEY)
        env.setenv("LANGFUSE_BASE_URL", running.base_url)
        env.delenv("LANGFUSE_HOST", raising=False)
        yield running
    running.server.shutdown()


@pytest.fixture(scope="module")
def exporter(receiver: LangfuseReceiver) -> Iterator[LangfuseExporter]:
    with LangfuseExporter() as created:
        yield created


# ----- the agent, and a judge that answers as scripted ---------------------------------------

City = Literal["Paris", "Rome", "Oslo", "Lima"]


@tool
def get_weather(city: City) -> str:
    """Get the current weather in a city"""
    return f"21 C and sunny in {city}"


def react_agent(llm: Any) -> Any:
    """First turn must call the tool, then it answers (the random tiny model would not, unprompted)."""

    def model(state: MessagesState, runtime: Any) -> Any:
        first_turn = not any(m.type == "tool" for m in state["messages"])
        return llm.bind_tools([get_weather], tool_choice="required" if first_turn else "none",
                              parallel_tool_calls=False)

    return create_react_agent(model, [get_weather])


class ScriptedJudge:
    """An OpenAI-compatible judge: scores the ids the RULER schema pins, 0.2 apart, explaining each."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                schema = body["response_format"]["json_schema"]["schema"]
                ids = [item["properties"]["trajectory_id"]["enum"][0]
                       for item in schema["properties"]["scores"]["prefixItems"]]
                answer = {"scores": [{"trajectory_id": i, "explanation": f"{i} called the tool",
                                      "score": round(0.9 - 0.2 * n, 2)} for n, i in enumerate(ids)]}
                payload = json.dumps({"id": "judge", "object": "chat.completion", "created": 0, "model": "judge",
                                      "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                          "role": "assistant", "content": json.dumps(answer)}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.judge = Judge(base_url=f"http://127.0.0.1:{self.server.server_address[1]}/v1", model="judge")


# ----- one training run: gathered with live export, trained, validated, stored ---------------


@dataclass
class Run:
    art_dir: Path
    train_groups: list[TrajectoryGroup]
    val_groups: list[TrajectoryGroup]
    gather_output: str


@pytest.fixture(scope="module")
async def run(exporter: LangfuseExporter, tmp_path_factory: pytest.TempPathFactory) -> Run:
    art_dir = tmp_path_factory.mktemp("art")
    judge = ScriptedJudge()
    async with tiny_backend(art_dir) as backend:
        model = TrainableModel(name="agent", project="lf-demo")
        await model.register(backend)
        agent = react_agent(ChatART.from_model(model, max_tokens=40, timeout=30))

        async def rollout(city: str) -> Trajectory:
            async with art_capture(scenario=city) as trajectory:
                await agent.ainvoke({"messages": [("user", f"What is the weather in {city}?")]})
            asked = trajectory.choices()[0].message["tool_calls"][0]["function"]["arguments"]
            trajectory.metrics["right_city"] = city in asked
            trajectory.reward = 0.5 * trajectory.metrics["right_city"]
            return trajectory

        printed = StringIO()
        with redirect_stdout(printed):
            train_groups = await gather_trajectory_groups(
                [trajectory_group(lambda city=city: rollout(city), n=2, scenario=city) for city in ("Paris", "Oslo")],
                after_each=ruler(judge.judge), langfuse=exporter.for_step(model, await model.get_step()))
        await model.train(train_groups, TrainConfig(learning_rate=1e-3))
        val_groups = await gather_trajectory_groups([trajectory_group(lambda: rollout("Rome"), n=2, scenario="Rome")],
                                                    progress=False)
        await model.log(val_groups, split="val")
    judge.server.shutdown()
    return Run(art_dir, list(train_groups), list(val_groups), printed.getvalue())


def assert_main_history(receiver: LangfuseReceiver, parent: Span, trajectory: Trajectory, served: str) -> None:
    """Under `parent`: a generation per model turn (its prompt, reply, model and token counts),
    each followed by a tool span per call (arguments in, the tool's answer out)."""
    expected: list[tuple[str, str]] = []
    for choice in trajectory.choices():
        expected.append(("generation", "model call"))
        expected += [("tool", c["function"]["name"]) for c in choice.message.get("tool_calls") or []]
    spans = receiver.children(parent)
    assert [(s.type, s.name) for s in spans] == expected
    generations = [s for s in spans if s.type == "generation"]
    items = trajectory.messages_and_choices
    for span, choice in zip(generations, trajectory.choices()):
        position = next(i for i, item in enumerate(items) if item is choice)
        assert span.input == [i.message if isinstance(i, Choice) else i for i in items[:position]]
        assert span.output == choice.message and span.model == served
        assert span.usage == {"input": len(choice.prompt_token_ids), "output": len(choice.token_ids),
                              "total": len(choice.prompt_token_ids) + len(choice.token_ids)}
        assert span.metadata("exact_tokens") is True and span.metadata("tools") == ["get_weather"]


def test_live_export_sends_each_gathered_trajectory_as_a_trace(receiver: LangfuseReceiver, run: Run) -> None:
    assert "langfuse: 4 traces and 20 scores exported to Langfuse; 0 failed, 0 upload errors" in run.gather_output
    assert receiver.authorizations == {"Basic " + base64.b64encode(f"{PUBLIC_KEY}:{SECRET_KEY}".encode()).decode()}
    assert receiver.unexpected == []
    for group_index, group in enumerate(run.train_groups):
        for index, trajectory in enumerate(group.trajectories):
            trace_id = trajectory.metadata["langfuse_trace_id"]
            root = receiver.root(trace_id)
            city = group.metadata["scenario"]
            assert (root.name, root.type, root.attributes["langfuse.trace.name"]) == ("rollout", "agent", "agent")
            assert root.tags == ["project:lf-demo", "model:agent", "step:0", "split:train", f"scenario:{city}"]
            assert root.trace_metadata == {"project": "lf-demo", "model": "agent", "step": 0, "split": "train",
                                           "scenario": city, "group": group_index, "trajectory": index}
            assert root.input == [{"role": "user", "content": f"What is the weather in {city}?"}]
            assert root.output == trajectory.messages()[-1]
            assert_main_history(receiver, root, trajectory, "agent@0")
            (tool_span,) = [s for s in receiver.children(root) if s.type == "tool"]
            call = trajectory.choices()[0].message["tool_calls"][0]
            assert tool_span.input == json.loads(call["function"]["arguments"])
            assert tool_span.output == f"21 C and sunny in {tool_span.input['city']}"
            assert all(s.tags == root.tags for s in receiver.trace(trace_id))  # every observation filters alike


def test_reward_metrics_and_ruler_explanation_become_scores(receiver: LangfuseReceiver, run: Run) -> None:
    for group in run.train_groups:
        for trajectory in group.trajectories:
            scores = receiver.scores_of(trajectory.metadata["langfuse_trace_id"])
            explanation = trajectory.metadata["ruler_explanation"]
            assert explanation.endswith("called the tool")  # the judge's words, by id
            assert set(scores) == {"reward", "right_city", "model_calls", "independent_reward", "ruler_score"}
            for name in ("reward", "ruler_score"):
                assert (scores[name]["value"], scores[name]["comment"]) == (trajectory.reward, explanation)
            assert scores["independent_reward"]["value"] == 0.5 * trajectory.metrics["right_city"]
            assert scores["right_city"]["dataType"] == "BOOLEAN"
            assert scores["right_city"]["value"] == float(trajectory.metrics["right_city"])
            assert (scores["model_calls"]["value"], scores["model_calls"]["dataType"]) == (2.0, "NUMERIC")
    rewards = sorted(t.reward for g in run.train_groups for t in g.trajectories)
    assert set(rewards) <= {0.9, 0.7}  # the judge's scores, not the rollouts' own rewards


def command(art_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "art_integrations.observability.langfuse", "--art-dir", str(art_dir),
                           "--project", "lf-demo", "--model", "agent", *args],
                          capture_output=True, text=True, env=checkout_env(), timeout=120, cwd=ROOT, check=False)


def test_stored_trajectories_are_exported_afterwards(receiver: LangfuseReceiver, run: Run) -> None:
    done = command(run.art_dir)
    assert done.returncode == 0, done.stderr
    # the val groups were not exported live; the train groups were, and are skipped
    assert done.stdout.strip().splitlines()[-1] == (
        "langfuse: 2 files of lf-demo/agent: 2 traces and 6 scores exported to Langfuse; 0 failed, 0 upload errors; "
        "4 skipped, exported live before (--again sends them again)")
    val_traces = receiver.traces_tagged("split:val")
    assert len(val_traces) == 2
    stored_val = run.val_groups[0].trajectories
    for index, trace_id in enumerate(sorted(val_traces, key=lambda t: receiver.root(t).trace_metadata["trajectory"])):
        root = receiver.root(trace_id)
        assert root.tags == ["project:lf-demo", "model:agent", "step:1", "split:val", "scenario:Rome"]
        assert root.trace_metadata["trajectory"] == index
        assert_main_history(receiver, root, stored_val[index], "agent@1")  # validated with the trained policy
        assert receiver.scores_of(trace_id)["reward"]["value"] == stored_val[index].reward

    # train/0001.jsonl holds the rollouts of policy step 0: --step 0 selects them, --again resends them
    again = command(run.art_dir, "--step", "0", "--split", "train", "--again")
    assert again.returncode == 0, again.stderr
    assert "langfuse: 1 files of lf-demo/agent: 4 traces and 20 scores exported" in again.stdout
    live = {t.metadata["langfuse_trace_id"]: t for g in run.train_groups for t in g.trajectories}
    resent = [t for t in receiver.traces_tagged("split:train", "step:0") if t not in live]
    assert len(resent) == 4
    def position(trace_id: str) -> tuple[int, int]:  # group (line of the file) and trajectory
        metadata = receiver.root(trace_id).trace_metadata
        return metadata["group"], metadata["trajectory"]

    live_at = {position(t): trajectory for t, trajectory in live.items()}
    for trace_id in resent:
        root = receiver.root(trace_id)
        original = live_at[position(trace_id)]
        assert root.input == receiver.root(original.metadata["langfuse_trace_id"]).input
        assert receiver.scores_of(trace_id)["reward"]["value"] == original.reward
        assert [(s.type, s.name) for s in receiver.children(root)] == [("generation", "model call"),
                                                                       ("tool", "get_weather"),
                                                                       ("generation", "model call")]


@pytest.fixture(scope="module")
def tiny_llm(tiny_server: ServerThread) -> ChatART:
    return ChatART(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", max_tokens=24, timeout=30)


def test_sub_agents_and_branches_nest_under_their_own_spans(receiver: LangfuseReceiver, exporter: LangfuseExporter,
                                                            tiny_llm: ChatART) -> None:
    def researcher(state: MessagesState) -> dict:
        return {"messages": [tiny_llm.invoke([SystemMessage("You research."), state["messages"][0]])]}

    def supervisor(state: MessagesState) -> dict:
        reply = tiny_llm.invoke(state["messages"])
        tiny_llm.invoke([HumanMessage("Plan the search first.")])  # a side conversation: a branch
        return {"messages": [reply]}

    with art_capture(scenario="owls") as trajectory:
        supervisor_graph(supervisor, researcher).invoke({"messages": [HumanMessage("Find facts about owls.")]})
    assert trajectory.metadata["additional_history_agents"] == ["main", "researcher"]

    (trace_id,) = exporter.export_group(TrajectoryGroup(trajectories=[trajectory]),
                                        TraceLabels("lf-nesting", "boss", 7, "val"))
    exporter.flush()
    root = receiver.root(trace_id)
    assert [(s.type, s.name) for s in receiver.children(root)] == [
        ("generation", "model call"), ("chain", "branch"), ("agent", "researcher")]
    branch, sub_agent = receiver.children(root)[1:]
    assert branch.metadata("kind") == "branch" and sub_agent.metadata("kind") == "sub-agent"
    (planned,) = receiver.children(branch)
    assert planned.input == [{"role": "user", "content": "Plan the search first."}] and planned.model == "boss@7"
    (researched,) = receiver.children(sub_agent)
    assert researched.input == [{"role": "system", "content": "You research."},
                                {"role": "user", "content": "Find facts about owls."}]
    assert researched.output == trajectory.additional_histories[1].choices()[0].message
    assert sub_agent.input == researched.input and sub_agent.output == researched.output
    assert all("step:7" in s.tags and "scenario:owls" in s.tags for s in receiver.trace(trace_id))


@pytest.mark.parametrize("capture", ["ChatART", "ARTCallbackHandler"])
async def test_capture_and_the_langfuse_langchain_handler_share_a_run(
        receiver: LangfuseReceiver, exporter: LangfuseExporter, tiny_server: ServerThread, capture: str) -> None:
    from langfuse.langchain import CallbackHandler

    if capture == "ChatART":
        llm: ChatOpenAI = ChatART(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", max_tokens=40,
                                  timeout=30)
        callbacks: list[Any] = [CallbackHandler()]
    else:
        llm = ChatOpenAI(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                         max_tokens=40, timeout=30, extra_body={"return_token_ids": True})
        callbacks = [ARTCallbackHandler(), CallbackHandler()]
    seen = {s.trace for s in receiver.spans}
    async with art_capture(scenario=capture) as trajectory:
        await react_agent(llm).ainvoke({"messages": [("user", "weather in Lima?")]}, config={"callbacks": callbacks})
    # the capture is whole: both turns, with their exact tokens
    assert len(trajectory.choices()) == 2 and "capture_errors" not in trajectory.metrics
    assert all(c.token_ids and c.prompt_token_ids for c in trajectory.choices())

    (ours,) = exporter.export_group(TrajectoryGroup(trajectories=[trajectory]),
                                    TraceLabels("lf-coexist", "agent", 0, capture))
    exporter.flush()
    (theirs,) = {s.trace for s in receiver.spans} - seen - {ours}  # the handler's trace of the same run
    handler_generations = [s for s in receiver.trace(theirs) if s.type == "generation"]
    assert [s.model for s in handler_generations] == ["tiny-random-smollm2"] * 2
    handler_tools = [s.name for s in receiver.trace(theirs) if s.type == "tool"]
    assert handler_tools == ["get_weather"]
    # both saw the same replies: the tool call, then the answer
    first, second = trajectory.choices()
    assert handler_generations[0].output["tool_calls"][0]["args"] == json.loads(
        first.message["tool_calls"][0]["function"]["arguments"])
    assert handler_generations[1].output["content"] == second.message["content"]
    assert [(s.type, s.name) for s in receiver.children(receiver.root(ours))] == [
        ("generation", "model call"), ("tool", "get_weather"), ("generation", "model call")]
    assert receiver.unexpected == []  # neither our export nor the handler asked for anything else


async def test_refused_uploads_are_counted_and_warned_never_raised(
        receiver: LangfuseReceiver, exporter: LangfuseExporter, tiny_llm: ChatART,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    async def rollout() -> Trajectory:
        async with art_capture() as trajectory:
            await tiny_llm.ainvoke("hello")
        trajectory.reward = 1.0
        return trajectory

    before = exporter.report()
    receiver.refuse = True
    try:
        with caplog.at_level(logging.WARNING):
            groups = await gather_trajectory_groups([trajectory_group(rollout, n=2, scenario="refused")],
                                                    langfuse=exporter.for_step("agent", 0, project="lf-refused"))
    finally:
        receiver.refuse = False
    assert len(groups) == 1 and len(groups[0].trajectories) == 2  # gathering went on
    after = exporter.report()
    assert after.traces - before.traces == 2 and after.failures == before.failures
    errors = after.upload_errors - before.upload_errors
    assert errors >= 2  # the span batch and the score batch were both refused
    assert not after.ok
    warning = [r.getMessage() for r in caplog.records if r.name == "art_integrations.observability.langfuse"]
    assert any(f"the SDK logged {errors} upload errors" in w for w in warning), warning
    assert f"{errors} upload errors" in capsys.readouterr().out
    assert receiver.traces_tagged("project:lf-refused") == []


def test_a_missing_sdk_or_missing_keys_are_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LANGFUSE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("LANGFUSE_SECRET_KEY", raising=False)
    with pytest.raises(ValueError, match="set LANGFUSE_PUBLIC_KEY and LANGFUSE_SECRET_KEY"):
        LangfuseExporter()
    monkeypatch.setitem(sys.modules, "langfuse", None)  # as if not installed
    with pytest.raises(ImportError, match=r'pip install "art-integrations\[langfuse\]"'):
        LangfuseExporter()
