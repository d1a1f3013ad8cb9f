"""Captures never lose a call silently: a call finishing after its capture exited, a capture
that recorded nothing, a chat model without our handler: each is warned (the `art_capture`
log line) and counted (`metrics["capture_errors"]`, the trajectory's `logs`, gather's summary),
hit the way a user hits them: real agents against the tiny model, real asyncio tasks."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from langchain_openai import ChatOpenAI
from llama_index.llms.openai_like import OpenAILike

from art_integrations import Trajectory, art_capture, gather_trajectory_groups, trajectory_group
from art_integrations.langchain import ChatART
from art_integrations.llamaindex import ARTLLM
from tests.conftest import ServerThread
from tests.test_langgraph import react_agent
from tests.test_llamaindex import clean_dispatcher, function_agent  # noqa: F401 - clean_dispatcher: a fixture

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")

LATE = ("capture error: a model call finished after its art_capture() had exited (a task started inside the "
        "capture and awaited outside it?), so it is not in the trajectory: await every task the rollout starts "
        "before leaving the `with art_capture()` block")
EMPTY = "capture error: art_capture() recorded no model call, so the trajectory is empty. Likely causes: "
PLAIN_CHAT_OPENAI = (
    "capture error: art_capture() recorded no model call, but 2 calls to a LangChain ChatOpenAI with no "
    "ARTCallbackHandler ran inside it unrecorded: use ChatART, or pass config={'callbacks': [ARTCallbackHandler()]} "
    "to the agent and extra_body={'return_token_ids': True} to the chat model")
PLAIN_OPENAI_LIKE = (
    "art_capture() recorded no model call, but {n} to a LlamaIndex OpenAILike (not an ARTLLM, and no "
    "instrument()) ran inside it unrecorded: use ARTLLM, or call art_integrations.llamaindex.instrument() once to "
    "record every LLM, and pass additional_kwargs={{'extra_body': {{'return_token_ids': True}}}} to it")


@pytest.fixture(scope="module")
def chat_art(tiny_server: ServerThread) -> ChatART:
    return ChatART(model="tiny-random-smollm2", base_url=f"{tiny_server.base_url}/v1", max_tokens=40, timeout=30)


@pytest.fixture(scope="module")
def chat_openai(other_server: ServerThread) -> ChatOpenAI:
    """The user's own ChatOpenAI, set up for the handler as docs/integrations/langgraph.md says, but with no handler, at
    a server that is not an art-backend (at one, the capture records it where the openai SDK sends it)."""
    return ChatOpenAI(model="tiny-random-smollm2", base_url=f"{other_server.base_url}/v1", api_key="unused",
                      max_tokens=40, timeout=30, extra_body={"return_token_ids": True})


async def test_a_call_finishing_after_its_capture_is_warned_and_counted(
        chat_art: ChatART, caplog: pytest.LogCaptureFixture) -> None:
    async with art_capture() as trajectory:
        await chat_art.ainvoke("recorded")
        background = asyncio.create_task(chat_art.ainvoke("a summary nobody awaits in time"))
        await asyncio.sleep(0)  # under way: its request is out when the capture exits
    await background
    assert trajectory.metrics == {"model_calls": 1, "capture_errors": 1} and len(trajectory.choices()) == 1
    assert trajectory.logs == [LATE]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        LATE.replace("capture error: ", "art_capture: ")]


async def test_an_agent_left_running_after_its_capture(chat_art: ChatART) -> None:
    async with art_capture() as trajectory:
        run = asyncio.create_task(react_agent(chat_art).ainvoke({"messages": [("user", "weather in Oslo?")]}))
    await run
    empty, *late = trajectory.logs
    assert empty.startswith(EMPTY) and "the calls ran in a task still running when the capture exited" in empty
    assert late == [LATE, LATE]  # the tool call and the answer
    assert trajectory.metrics == {"model_calls": 0, "capture_errors": 3} and not trajectory.messages_and_choices


async def test_a_plain_chat_openai_without_the_handler_is_named(chat_openai: ChatOpenAI, chat_art: ChatART,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async with art_capture() as trajectory:
        await react_agent(chat_openai).ainvoke({"messages": [("user", "weather in Oslo?")]})
    assert trajectory.logs == [PLAIN_CHAT_OPENAI]
    assert trajectory.metrics == {"model_calls": 0, "capture_errors": 1}
    assert PLAIN_CHAT_OPENAI.replace("capture error: ", "art_capture: ") in caplog.text

    # beside the policy, the same ChatOpenAI is a judge or helper the user chose not to train on
    async with art_capture() as judged:
        await chat_art.ainvoke("policy")
        await chat_openai.ainvoke("judge this")
    assert judged.metrics == {"model_calls": 1} and not judged.logs


async def test_gather_counts_capture_errors_in_its_summary(chat_openai: ChatOpenAI,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    async def rollout() -> Trajectory:
        async with art_capture() as trajectory:
            await chat_openai.ainvoke("hi")
        return trajectory

    (group,) = await gather_trajectory_groups([trajectory_group(rollout, n=2)])
    assert [t.metrics["capture_errors"] for t in group.trajectories] == [1, 1]
    assert "0 failed rollouts, 2 capture errors (see each trajectory's logs)" in capsys.readouterr().out


@pytest.mark.usefixtures("clean_dispatcher")  # no handler of ours installed, as for a user who never made one
async def test_a_plain_openai_like_without_the_handler_is_named(other_server: ServerThread) -> None:
    llm = OpenAILike(model="tiny-random-smollm2", api_base=f"{other_server.base_url}/v1", api_key="unused",
                     is_chat_model=True, is_function_calling_model=True, max_tokens=40, timeout=30,
                     additional_kwargs={"extra_body": {"return_token_ids": True}})
    async with art_capture() as trajectory:
        await function_agent(llm).run("weather in Oslo?")
    assert trajectory.logs == ["capture error: " + PLAIN_OPENAI_LIKE.format(n="2 calls")]
    assert trajectory.metrics == {"model_calls": 0, "capture_errors": 1}


async def test_a_llamaindex_agent_run_not_awaited_inside_its_capture(tiny_server: ServerThread) -> None:
    agent = function_agent(ARTLLM(model="tiny-random-smollm2", api_base=f"{tiny_server.base_url}/v1", max_tokens=40))
    async with art_capture() as trajectory:
        handler = agent.run("weather in Oslo?")  # starts the workflow; awaiting it is what was forgotten
    await handler
    empty, *late = trajectory.logs
    assert empty.startswith(EMPTY) and late and all(log == LATE for log in late)
    assert trajectory.metrics == {"model_calls": 0, "capture_errors": 1 + len(late)}


USER_SCRIPT = """
import asyncio, json, sys
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike
from art_integrations import art_capture

async def main(base_url):
    chat = ChatOpenAI(model="tiny-random-smollm2", base_url=base_url, api_key="unused", max_tokens=4)
    llm = OpenAILike(model="tiny-random-smollm2", api_base=base_url, api_key="unused", is_chat_model=True,
                     max_tokens=4)
    async with art_capture() as langchain:
        await chat.ainvoke("hi")
    async with art_capture() as llamaindex:
        await llm.achat([ChatMessage(role="user", content="hi")])
    print(json.dumps([langchain.logs, llamaindex.logs]))

asyncio.run(main(sys.argv[1]))
"""


def test_a_user_who_never_imported_our_integrations_is_told_the_model(other_server: ServerThread) -> None:
    """Only `art_capture` imported, and a plain model of each framework at a server that is not an
    art-backend: the capture still names it."""
    done = subprocess.run([sys.executable, "-c", USER_SCRIPT, f"{other_server.base_url}/v1"], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent, check=True)
    langchain, llamaindex = json.loads(done.stdout.splitlines()[-1])
    assert len(langchain) == 1 and "1 call to a LangChain ChatOpenAI with no ARTCallbackHandler" in langchain[0]
    assert llamaindex == ["capture error: " + PLAIN_OPENAI_LIKE.format(n="1 call")]
    assert "art_capture: art_capture() recorded no model call, but 1 call" in done.stderr
