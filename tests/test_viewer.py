"""`art-backend view`: a run trained for real on the tiny model (tool calls, tool results, a
sub-agent history, a RULER-scored group), then its pages over HTTP, bad input, the API key,
the command itself, and the pages rendered by headless Chromium (screenshot and DOM)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from typer.testing import CliRunner

from art_backend.cli import app as cli_app
from art_backend.viewer import Tokenizers, create_viewer_app
from art_backend.viewer.curve import SPLIT_COLOURS
from art_integrations import Choice, History, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup
from art_integrations.rewards import Judge, ruler_score_group
from art_integrations.wire import free_loopback_port
from tests.conftest import ServerThread, tiny_backend

CHROMIUM = Path("/usr/bin/chromium")
# Set, the browser test keeps its screenshots there too: `ART_SCREENSHOT_DIR=docs/img pytest tests/test_viewer.py -k
# chromium` refreshes the documentation's pictures of the viewer (docs/review.md).
SCREENSHOT_DIR = os.environ.get("ART_SCREENSHOT_DIR")
TRAINED_TOKEN_RGB = (0xFC, 0xD3, 0x4D)  # .tokens span.trained in the viewer's stylesheet
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"]}}}
TOOL_RESULT = "18 °C and sunny"
# The judge's explanations carry markup, to check the pages escape what trajectories contain.
EXPLANATION = "{id} called get_weather but its <b>answer</b> is gibberish"


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


# ----- a real run: rollouts on the tiny backend, RULER with a scripted judge, two GRPO steps -----

def scripted_judge() -> FastAPI:
    """An OpenAI-compatible judge answering RULER's request with fixed scores per id (the real
    `ruler_score_group` builds the request, parses the answer and applies it)."""
    judge = FastAPI()

    @judge.post("/v1/chat/completions")
    async def complete(request: Request) -> dict[str, Any]:
        body = await request.json()
        ids = re.findall(r"t\d+", re.search(r"Score every trajectory: (.*)\.", body["messages"][-1]["content"])[1])
        scores = [{"trajectory_id": i, "explanation": EXPLANATION.format(id=i), "score": round(0.9 - 0.3 * n, 2)}
                  for n, i in enumerate(ids)]
        return {"id": "judge", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": json.dumps({"scores": scores})}}]}

    return judge


async def rollout(model: TrainableModel, city: str, seed: int, reward: float, sub_agent: bool) -> Trajectory:
    """A tool-using rollout: a forced get_weather call, its result, a final answer; optionally a
    sub-agent conversation as an additional history. Every model turn has its exact tokens."""
    client = model.openai_client()

    async def turn(history: History, **settings: Any) -> None:
        response = await client.chat.completions.create(
            model=model.inference_name, messages=history.messages(), logprobs=True, seed=seed,
            extra_body={"return_token_ids": True}, **settings)
        history.messages_and_choices.append(Choice.from_openai(response))

    trajectory = Trajectory(tools=[WEATHER_TOOL], reward=reward, metadata={"city": city}, messages_and_choices=[
        {"role": "system", "content": "You answer weather questions with the get_weather tool."},
        {"role": "user", "content": f"What is the weather in {city}?"}])
    await turn(trajectory, tools=[WEATHER_TOOL], max_tokens=40,
               tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = trajectory.choices()[0].message["tool_calls"][0]
    trajectory.messages_and_choices.append({"role": "tool", "tool_call_id": call["id"], "content": TOOL_RESULT})
    await turn(trajectory, tools=[WEATHER_TOOL], max_tokens=6)
    if sub_agent:
        helper = History(messages_and_choices=[{"role": "user", "content": f"Summarise: {city} is sunny."}])
        await turn(helper, max_tokens=5)
        trajectory.additional_histories.append(helper)
    trajectory.metrics["turns"] = len(trajectory.choices())
    return trajectory


async def rollout_groups(model: TrainableModel, judge: Judge, offset: int,
                         rewards: list[float]) -> list[TrajectoryGroup]:
    """Three groups: rewards given (one rollout with a sub-agent), RULER-scored, all equal."""
    scored = TrajectoryGroup(metadata={"scenario": "paris"}, trajectories=[
        await rollout(model, "Paris", offset + i, reward, sub_agent=i == 0) for i, reward in enumerate(rewards)])
    judged = TrajectoryGroup(metadata={"scenario": "oslo"}, trajectories=[
        await rollout(model, "Oslo", offset + 10 + i, 0.5, sub_agent=False) for i in range(3)])
    judged = await ruler_score_group(judged, judge)
    assert judged is not None
    same = TrajectoryGroup(metadata={"scenario": "same"}, trajectories=[
        await rollout(model, "Paris", offset + 20 + i, 1.0, sub_agent=False) for i in range(2)])
    return [scored, judged, same]


@dataclass
class StoredRun:
    art_dir: Path
    step_one: list[TrajectoryGroup]  # the groups step 1 was trained on, as sent


@pytest.fixture(scope="module")
def stored_run(tmp_path_factory: pytest.TempPathFactory) -> StoredRun:
    art_dir = tmp_path_factory.mktemp("viewer") / ".art"

    async def run() -> list[TrajectoryGroup]:
        with ServerThread(scripted_judge()) as judge_server:
            judge = Judge(base_url=f"{judge_server.base_url}/v1", model="scripted-judge")
            async with tiny_backend(art_dir) as backend:
                model = TrainableModel(name="agent", project="demo")
                await model.register(backend)
                # the first group's rewards change from step to step, so the curves rise and differ
                await model.log(await rollout_groups(model, judge, 100, [0.0, 0.25, 0.5]), split="val")  # at step 0
                step_one = await rollout_groups(model, judge, 0, [0.0, 1.0, 0.5])
                assert (await model.train(step_one, TrainConfig(learning_rate=1e-3))).step == 1
                step_two = await rollout_groups(model, judge, 50, [0.5, 1.0, 1.0])
                assert (await model.train(step_two, TrainConfig(learning_rate=1e-3))).step == 2
                await model.log(await rollout_groups(model, judge, 200, [1.0, 1.0, 1.0]), split="val")  # at step 2
                return step_one

    return StoredRun(art_dir, asyncio.run(run()))


@pytest.fixture(scope="module")
def viewer(stored_run: StoredRun, cache_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(create_viewer_app(stored_run.art_dir, Tokenizers(cache_dir))) as running:
        yield running


# ----- reading the pages -----

class TokenSpans(HTMLParser):
    """The token view of each trajectory (article id "g<group>t<trajectory>"): (token id, trained, text)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_trajectory: dict[str, list[tuple[int, bool, str]]] = {}
        self._article: str | None = None
        self._token: tuple[int, bool] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "article":
            self._article = attributes["id"]
            self.by_trajectory[self._article] = []
        elif tag == "span" and attributes.get("data-id") is not None:
            self._token = (int(attributes["data-id"]), attributes.get("class") == "trained")
            assert self._article is not None
            self.by_trajectory[self._article].append((*self._token, ""))

    def handle_data(self, data: str) -> None:
        if self._token is not None and self._article is not None:
            token_id, trained, text = self.by_trajectory[self._article][-1]
            self.by_trajectory[self._article][-1] = (token_id, trained, text + data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "span":
            self._token = None


def chained_sequences(trajectory: Trajectory) -> tuple[list[list[int]], int]:
    """What training should see, stated independently of the trainer's code: per history, a turn
    whose prompt + completion starts with the running sequence continues it; any other turn
    starts a new sequence (a prefix break)."""
    sequences: list[list[int]] = []
    breaks = 0
    for history in trajectory.histories():
        running: list[int] = []
        for choice in history.choices():
            full = choice.prompt_token_ids + choice.token_ids
            if running and full[:len(running)] != running:
                sequences.append(running)
                breaks += 1
            running = full
        sequences.append(running)
    return sequences, breaks


def token_spans(html: str) -> dict[str, list[tuple[int, bool, str]]]:
    parser = TokenSpans()
    parser.feed(html)
    return parser.by_trajectory


def test_index_and_model_page_show_the_run_and_its_reward_curve(viewer: ServerThread, stored_run: StoredRun) -> None:
    index = httpx.get(viewer.base_url)
    assert index.status_code == 200
    assert 'href="/demo/agent"' in index.text and "tiny-random-smollm2" in index.text

    page = httpx.get(f"{viewer.base_url}/demo/agent")
    assert page.status_code == 200
    history_file = stored_run.art_dir / "demo" / "models" / "agent" / "history.jsonl"
    history = [json.loads(line) for line in history_file.read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in history] == [("val", 0), ("train", 1), ("train", 2), ("val", 2)]
    svg = page.text[page.text.index("<svg"):page.text.index("</svg>")]
    assert svg.count("<circle") == 4
    for split, colour in SPLIT_COLOURS.items():  # one line of two points per split, in its colour
        assert svg.count(f'stroke="{colour}"') == 1 and svg.count(f'fill="{colour}"') == 3  # 2 points, legend
        for record in (r for r in history if r["split"] == split):
            assert f"{split} step {record['step']}: mean reward {record['reward/mean']:.3f}" in svg
    for split, step in [("train", 1), ("train", 2), ("val", 0), ("val", 2)]:
        assert f'href="/demo/agent/{split}/{step}"' in page.text
    train_one = history[1]
    assert f">{train_one['loss']:.4g}<" in page.text  # the train step's loss in the steps table


def test_step_page_shows_groups_conversations_ruler_and_trained_tokens(
        viewer: ServerThread, stored_run: StoredRun, tiny_model_dir: Path) -> None:
    page = httpx.get(f"{viewer.base_url}/demo/agent/train/1")
    assert page.status_code == 200
    html = page.text
    assert html.count('<section class="group">') == 3 and html.count('<article class="trajectory"') == 8
    assert "scenario" in html and "paris" in html and "oslo" in html
    assert html.count("all rewards equal: no training signal") == 1  # the third group only
    assert html.count('<details class="token-view">') == 8  # folded unless ?tokens=open

    # conversations: the forced tool call with its arguments, the result named by its call, the sub-agent
    first = stored_run.step_one[0].trajectories[0]
    arguments = json.loads(first.choices()[0].message["tool_calls"][0]["function"]["arguments"])
    assert '<span class="name">get_weather</span>' in html
    assert json.dumps(arguments, indent=2).replace('"', "&#34;") in html
    assert html.count("tool result · get_weather") == 8 and TOOL_RESULT in html
    assert html.count("additional history 1 (1 model turn(s), 2 message(s))") == 1
    assert "Summarise: Paris is sunny." in html

    # RULER: explanations escaped, the prior reward kept as a metric
    judged = stored_run.step_one[1].trajectories
    for trajectory in judged:
        explanation = trajectory.metadata["ruler_explanation"]
        shown = explanation.replace("<", "&lt;").replace(">", "&gt;")
        assert f"<b>RULER</b> {shown}" in html and explanation not in html
        assert trajectory.metrics["independent_reward"] == 0.5
    assert [t.reward for t in judged] == [0.9, 0.6, 0.3]
    assert html.count("<th>independent_reward</th>") == 3

    # the token view: exactly the captured ids, the completions marked trained, each decoded alone
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    spans = token_spans(html)
    breaks_shown = re.findall(r'<span class="badge warn">(\d+) prefix break\(s\)</span>', html)
    breaks_expected = []
    for group_number, group in enumerate(stored_run.step_one, 1):
        for number, trajectory in enumerate(group.trajectories, 1):
            shown_tokens = spans[f"g{group_number}t{number}"]
            sequences, breaks = chained_sequences(trajectory)
            breaks_expected += [str(breaks)] if breaks else []
            assert [token_id for token_id, _, _ in shown_tokens] == [i for s in sequences for i in s]
            main = trajectory.choices()
            extra = [c for h in trajectory.additional_histories for c in h.choices()]
            trained = [token_id for token_id, in_mask, _ in shown_tokens if in_mask]
            assert trained == [i for c in main + extra for i in c.token_ids]
            # the forced tool call is plain ASCII, so the tokens decoded one by one join into its text
            call_ids = main[0].token_ids
            trained_texts = [text for _, in_mask, text in shown_tokens if in_mask]
            call_text = "".join(trained_texts[:len(call_ids)])
            assert call_text.replace("\u21b5", "") == tokenizer.decode(call_ids)
            assert '"name": "get_weather"' in call_text and call_text.endswith("<|im_end|>")
    assert breaks_shown == breaks_expected
    assert "<span>grey</span> ones are prompt" in html and "Decoded with the tokenizer of" in html


def test_bad_input_gets_a_404_page_naming_what_exists(viewer: ServerThread) -> None:
    cases = {
        "/nope": ("No project 'nope'", ['href="/demo"']),
        "/demo/nope": ("No model 'nope' in project 'demo'", ['href="/demo/agent"']),
        "/demo/agent/test/1": ("No split 'test' in demo/agent. Stored: train, val.", ['href="/demo/agent"']),
        "/demo/agent/train/7": ("No step '7' in demo/agent split 'train'. Stored: 1, 2.",
                                ['href="/demo/agent/train/1"', 'href="/demo/agent/train/2"']),
        "/demo/agent/val/last": ("No step 'last' in demo/agent split 'val'. Stored: 0, 2.",
                                 ['href="/demo/agent/val/0"']),
    }
    for path, (message, links) in cases.items():
        response = httpx.get(viewer.base_url + path)
        assert response.status_code == 404, path
        assert message.replace("'", "&#39;") in response.text, response.text
        assert all(link in response.text for link in links), path
    assert httpx.post(viewer.base_url + "/demo/agent").status_code == 405  # read-only: GET routes only
    assert httpx.get(viewer.base_url + "/docs").status_code == 404  # no page that loads scripts from a CDN


def test_an_api_key_guards_every_page(stored_run: StoredRun, cache_dir: Path) -> None:
    app = create_viewer_app(stored_run.art_dir, Tokenizers(cache_dir), api_key="s3cret")
    with ServerThread(app) as running:
        for path in ("/", "/demo/agent", "/demo/agent/train/1", "/nope"):
            refused = httpx.get(running.base_url + path)
            assert refused.status_code == 401 and "?key=KEY" in refused.text and "demo" not in refused.text
        for header, status in (("Bearer s3cret", 200), ("Bearer wrong", 401), ("s3cret", 401)):
            assert httpx.get(f"{running.base_url}/demo/agent", headers={"Authorization": header}).status_code == status
        assert httpx.get(f"{running.base_url}/demo/agent?key=wrong").status_code == 401
        with httpx.Client(base_url=running.base_url) as browser:
            opened = browser.get("/demo/agent/train/1?key=s3cret&tokens=open")
            assert opened.status_code == 303 and opened.headers["location"] == "/demo/agent/train/1?tokens=open"
            assert "httponly" in opened.headers["set-cookie"].lower()
            assert browser.get("/demo/agent/train/1?tokens=open").status_code == 200  # the cookie carries the key


def test_the_token_view_needs_the_base_models_tokenizer(stored_run: StoredRun, cache_dir: Path,
                                                        tiny_model_dir: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    art_dir = tmp_path / ".art"
    shutil.copytree(stored_run.art_dir, art_dir)
    saved = art_dir / "demo" / "models" / "agent" / "model.json"
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "base_model": "my-finetune"}))

    unknown = TestClient(create_viewer_app(art_dir, Tokenizers(cache_dir))).get("/demo/agent/train/1").text
    assert unknown.count("The base model &#39;my-finetune&#39; is not one the viewer knows by name") == 8
    assert "art-backend view --model DIR" in unknown and 'data-id="' not in unknown
    assert "reward <span class=\"reward\">0.9</span>" in unknown  # the rest of the page is unaffected

    given_app = create_viewer_app(art_dir, Tokenizers(cache_dir, model=str(tiny_model_dir)))
    given = TestClient(given_app).get("/demo/agent/train/1")
    assert f"Decoded with the tokenizer of {tiny_model_dir}" in given.text
    assert "recorded as &#39;my-finetune&#39;" in given.text
    assert given.text.count('class="trained" data-id=') > 0

    empty = TestClient(create_viewer_app(tmp_path / "nothing", Tokenizers(cache_dir))).get("/")
    assert empty.status_code == 200 and "No trained models under" in empty.text


def error_text(output: str) -> str:
    """The words of an error typer drew in a box, wrapped at any terminal width."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


def test_the_command_refuses_unsafe_or_unknown_settings(stored_run: StoredRun, tmp_path: Path) -> None:
    runner = CliRunner()
    exposed = runner.invoke(cli_app, ["view", "--art-dir", str(stored_run.art_dir), "--host", "0.0.0.0"],
                            env={"ART_BACKEND_API_KEY": None})
    assert exposed.exit_code == 2 and "--api-key" in error_text(exposed.output)
    unknown = runner.invoke(cli_app, ["view", "--art-dir", str(stored_run.art_dir), "--project", "demo",
                                      "--name", "nope"])
    assert unknown.exit_code == 2 and "Stored: agent" in error_text(unknown.output)
    absent = tmp_path / ("absent-" + "x" * 90)  # long enough that the box wraps it
    missing = runner.invoke(cli_app, ["view", "--art-dir", str(absent)])
    assert missing.exit_code == 2 and "does not exist" in error_text(missing.output)


@pytest.fixture(scope="module")
def viewer_command(stored_run: StoredRun, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`art-backend view` in a child process; yields the model page's address it prints."""
    log = tmp_path_factory.mktemp("viewer-command") / "output.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "art_backend", "view", "--art-dir", str(stored_run.art_dir), "--project", "demo",
             "--name", "agent", "--port", str(free_loopback_port())],
            stdout=output, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"the viewer did not start: {log.read_text()}"
            announced = re.search(r"Viewing .* at (http://\S+)", log.read_text())
            if announced:
                try:
                    httpx.get(announced[1], timeout=5)
                    break
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        yield announced[1]
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_command_serves_the_chosen_model_on_loopback(viewer_command: str) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/demo/agent", viewer_command)
    page = httpx.get(viewer_command)
    assert page.status_code == 200 and "<svg" in page.text and "Mean reward per step" in page.text


# ----- in a browser -----

def chromium(*arguments: str, profile: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--force-device-scale-factor=1", f"--user-data-dir={profile}", *arguments],
                          capture_output=True, text=True, timeout=180, check=True)


def colour_counts(png: Path) -> dict[tuple[int, int, int], int]:
    from PIL import Image

    with Image.open(png) as image:
        counts = image.convert("RGB").getcolors(maxcolors=1 << 24)
    assert counts is not None
    return {colour: count for count, colour in counts}


def keep_for_docs(model_png: Path, step_png: Path, folder: Path) -> None:
    """The model page whole, and the top of the step page (its first group's conversations and
    token views), as the documentation shows them."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_png, folder / "viewer-model.png")
    with Image.open(step_png) as image:
        image.crop((0, 0, image.width, 1200)).save(folder / "viewer-step.png", optimize=True)


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} is absent (Debian's chromium package): "
                                                  "no browser to render the pages in")
def test_pages_render_in_headless_chromium(viewer_command: str, stored_run: StoredRun, tmp_path: Path) -> None:
    profile = tmp_path / "chromium-profile"
    model_png, step_png = tmp_path / "model.png", tmp_path / "step.png"
    step_url = viewer_command + "/train/1?tokens=open"
    chromium(f"--screenshot={model_png}", "--window-size=1280,900", viewer_command, profile=profile)
    chromium(f"--screenshot={step_png}", "--window-size=1600,2400", step_url, profile=profile)

    on_model_page, on_step_page = colour_counts(model_png), colour_counts(step_png)
    for colour in SPLIT_COLOURS.values():  # both curves drawn (points are 10 px discs, lines 2.5 px)
        assert on_model_page.get(_rgb(colour), 0) > 400, colour  # about 750 and 1150 when drawn
        assert on_step_page.get(_rgb(colour), 0) > 400, colour
    assert on_step_page.get(TRAINED_TOKEN_RGB, 0) > 10_000  # trained tokens highlighted, in view (about 26,000)
    assert on_model_page.get(TRAINED_TOKEN_RGB, 0) == 0  # the highlight colour means trained tokens only
    if SCREENSHOT_DIR:
        keep_for_docs(model_png, step_png, Path(SCREENSHOT_DIR))

    dom = chromium("--dump-dom", step_url, profile=profile).stdout
    explanation = stored_run.step_one[1].trajectories[0].metadata["ruler_explanation"]
    assert explanation.replace("<", "&lt;").replace(">", "&gt;") in dom
    assert "tool result · get_weather" in dom and TOOL_RESULT in dom
    completions = [c for g in stored_run.step_one for t in g.trajectories for h in t.histories() for c in h.choices()]
    assert dom.count('class="trained" data-id=') == sum(len(c.token_ids) for c in completions)
    assert dom.count("<details class=\"token-view\" open") == 8
