"""Per-call overhead of trajectory capture against a plain call (ChatOpenAI, openai SDK) to the same server.

A real `python -m art_backend serve --model tiny-random-smollm2` subprocess (its own process, so
it never shares the GIL with the client being timed) answers every variant; each call is
`llm.invoke(PROMPT)` with max_tokens=4, temperature=0:
  A  plain ChatOpenAI (baseline, no capture)
  B  plain ChatOpenAI + extra_body={"return_token_ids": True} (server-side token recording)
  C  ChatART, one `with art_capture():` per call
  D  ChatART, 10 calls per capture (the capture's fixed cost shared by 10 calls)
  E  ChatOpenAI + return_token_ids + config={"callbacks": [ARTCallbackHandler()]}, capture per call
  G  E's handler path as training runs it: `gather_trajectories` of 10 rollouts (one `ainvoke`
     in `async with art_capture()` each), against 10 concurrent plain `ainvoke` calls (G0)
  H  the plain `openai` SDK (`client.chat.completions.create`), captured at its transport, one
     `with art_capture():` per call, against the same SDK call uncaptured (H0)
  I  H with 10 calls per capture, against 10 x H0
  J, K, L  a hand-written chat-completions POST through requests, httpx2 (the openai SDK 3.x's client;
     where installed) and aiohttp, captured at that client's transport, one `with art_capture():` per
     call, against the same call uncaptured (J0, K0, L0)
After a warm-up, each round runs A, B, C, E interleaved call by call (order rotated), and each
call's overhead is paired with the plain call (A) made right beside it, so the drift of a shared,
noisy machine cancels out; D and G run as blocks beside their baseline block (10 x A; G0). A
round's value is the median paired overhead per call; reported is the median over rounds, and
PASS when it is < max(1 ms, 2% of the baseline). Also timed without HTTP (us): the handler's
on_chat_model_start + on_llm_end on a fake reply, and a capture's enter + close + `assemble()`.
Every variant's tokens take the one path: the transport reads them from the reply (the server is
a LocalBackend's, which names its URL to the capture, so each reply brings its tokens' logprobs),
and the calls ChatART's and the user's handler record are joined to the transport's
by record id, adding the LangGraph agent and node: no variant makes a request of its own.

With --art-python (an interpreter of a separate venv with `openpipe-art`, which brings ~50
packages we keep out of ours), each round also runs benchmarks/art_langgraph_calls.py there:
  F  ART's `art.langgraph` wrapper (wrap_rollout + init_chat_model), one rollout per call,
     against `ChatOpenAI.ainvoke` in that venv (F0) as its own baseline.

Run from the repository root:
    ART_BACKEND_CACHE_DIR=/tmp/artcache PYTHONPATH=backend:. python benchmarks/bench_capture.py \
        [--calls 50] [--rounds 5] [--model embedded] [--art-python /tmp/artvenv/bin/python] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import functools
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import httpx
import openai
from art_backend.config import BackendSettings
from art_backend.model_store import resolve_model_dir
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_openai import ChatOpenAI

from art_integrations import LocalBackend, Trajectory, gather_trajectories
from art_integrations.capture import art_capture
from art_integrations.capture.scope import ModelCall, record_call
from art_integrations.capture.tokens import exact_choice
from art_integrations.capture.assembly import assemble
from art_integrations.langchain.callback import ARTCallbackHandler
from art_integrations.langchain.chat_model import ChatART

TINY = "tiny-random-smollm2"
PROMPT = "Say hello."
WARMUP = 5
PER_SCOPE_D = 10
GROUP_G = 10
# variants with a baseline of their own; the others are against A
BASELINES = {"F": "F0", "G": "G0", "H": "H0", "I": "H0", "J": "J0", "K": "K0", "L": "L0"}
MICRO_ITERATIONS = 2000
ART_SCRIPT = Path(__file__).with_name("art_langgraph_calls.py")
Variant = Callable[[int], list[float]]  # runs n calls, returns per-call seconds


@contextmanager
def backend_server(model: str) -> Iterator[tuple[str, str]]:
    """The backend as a child process (its own GIL, as in real use); yields its /v1 URL and
    the served model name."""
    log = tempfile.NamedTemporaryFile(prefix="bench-capture-", suffix=".log", delete=False)
    backend = LocalBackend(in_process=False, model=model, art_dir=tempfile.mkdtemp(), log_file=log.name)
    try:
        served = httpx.get(f"{backend.base_url}/v1/models").json()["data"][0]["id"]
        yield f"{backend.base_url}/v1", served
    finally:
        backend.stop()


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def checked_capture(fn: Callable[[], object], calls: int) -> None:
    """Run `fn` in a capture and check that every call was recorded with exact tokens."""
    with art_capture() as trajectory:
        fn()
    if trajectory.metrics.get("model_calls") != calls or trajectory.metrics.get("capture_errors"):
        raise RuntimeError(f"capture did not record {calls} call(s): {trajectory.metrics} {trajectory.logs}")


@dataclass
class Block:
    """A variant timed as a block of `calls` calls against a baseline block run right beside it."""

    baseline: str  # the baseline's row
    run_baseline: Callable[[], object]
    run: Callable[[], object]
    calls: int


def build_variants(base_url: str, model: str) -> tuple[dict[str, Callable[[], object]], dict[str, Block]]:
    """One call of each of A, B, C, E; and the block variants D (vs 10 x A) and G (vs G0)."""
    common = {"model": model, "base_url": base_url, "api_key": "unused", "max_tokens": 4, "temperature": 0}
    plain, tokens = ChatOpenAI(**common), ChatOpenAI(**common, extra_body={"return_token_ids": True})
    art, handler = ChatART(**common), ARTCallbackHandler()
    sdk = openai.OpenAI(base_url=base_url, api_key="unused")

    def sdk_call() -> object:
        return sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                           temperature=0)

    config: Any = {"callbacks": [handler]}
    loop = asyncio.new_event_loop()  # one loop for every async block: the clients' pools stay warm

    async def handler_rollout() -> Trajectory:
        async with art_capture() as trajectory:
            await tokens.ainvoke(PROMPT, config=config)
        return trajectory

    async def concurrent_plain() -> None:
        await asyncio.gather(*(plain.ainvoke(PROMPT) for _ in range(GROUP_G)))

    async def gathered_group() -> None:
        group = await gather_trajectories(handler_rollout, GROUP_G)
        if len(group.trajectories) != GROUP_G or not all(c.token_ids for t in group.trajectories
                                                         for c in t.choices()):
            raise RuntimeError(f"gather did not record every call with tokens: {group.exceptions}")

    singles = {
        "A plain ChatOpenAI": lambda: plain.invoke(PROMPT),
        "B + return_token_ids": lambda: tokens.invoke(PROMPT),
        "C ChatART, capture/call": lambda: checked_capture(lambda: art.invoke(PROMPT), 1),
        "E handler, capture/call": lambda: checked_capture(lambda: tokens.invoke(PROMPT, config=config), 1),
    }
    blocks = {
        f"D ChatART, {PER_SCOPE_D} calls/capture": Block(
            "A plain ChatOpenAI", lambda: [plain.invoke(PROMPT) for _ in range(PER_SCOPE_D)],
            lambda: checked_capture(lambda: [art.invoke(PROMPT) for _ in range(PER_SCOPE_D)], PER_SCOPE_D),
            PER_SCOPE_D),
        f"G handler, gathered group of {GROUP_G}": Block(
            f"G0 {GROUP_G} concurrent plain ainvoke", lambda: loop.run_until_complete(concurrent_plain()),
            lambda: loop.run_until_complete(gathered_group()), GROUP_G),
        "H openai SDK, capture/call": Block(
            "H0 plain openai SDK", lambda: [sdk_call() for _ in range(PER_SCOPE_D)],
            lambda: [checked_capture(sdk_call, 1) for _ in range(PER_SCOPE_D)], PER_SCOPE_D),
        f"I openai SDK, {PER_SCOPE_D} calls/capture": Block(
            "H0 plain openai SDK", lambda: [sdk_call() for _ in range(PER_SCOPE_D)],
            lambda: checked_capture(lambda: [sdk_call() for _ in range(PER_SCOPE_D)], PER_SCOPE_D), PER_SCOPE_D),
    }
    blocks.update(transport_blocks(base_url, model, loop))
    return singles, blocks


def transport_blocks(base_url: str, model: str, loop: asyncio.AbstractEventLoop) -> dict[str, Block]:
    """J, K, L: one hand-written POST per call through requests, httpx2 and aiohttp, captured at their
    transports (`art_integrations/capture/transports/`), each against the same call uncaptured."""
    import requests

    url = f"{base_url}/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
    session = requests.Session()
    calls: dict[str, tuple[str, Callable[[], object]]] = {
        "J requests": ("J0 plain requests", lambda: session.post(url, json=body, timeout=60).raise_for_status())}
    if importlib.util.find_spec("httpx2") is not None:
        import httpx2

        client = httpx2.Client(timeout=60)
        calls["K httpx2"] = ("K0 plain httpx2", lambda: client.post(url, json=body).raise_for_status())
    import aiohttp

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    aio = loop.run_until_complete(open_session())
    atexit.register(lambda: loop.is_closed() or loop.run_until_complete(aio.close()))  # the bench's loop lives on

    async def aiohttp_post() -> None:
        async with aio.post(url, json=body) as response:
            response.raise_for_status()
            await response.json()

    calls["L aiohttp"] = ("L0 plain aiohttp", lambda: loop.run_until_complete(aiohttp_post()))
    return {f"{name}, capture/call": Block(
        baseline, functools.partial(lambda call: [call() for _ in range(PER_SCOPE_D)], call),
        functools.partial(lambda call: [checked_capture(call, 1) for _ in range(PER_SCOPE_D)], call), PER_SCOPE_D)
        for name, (baseline, call) in calls.items()}


def run_art_script(art_python: str, base_url: str, model: str, calls: int) -> dict[str, list[float]]:
    """F0/F per-call seconds, alternating call by call in ART's own venv and process."""
    out = subprocess.run([art_python, str(ART_SCRIPT), base_url, model, str(calls)], capture_output=True,
                         text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{ART_SCRIPT.name} failed under {art_python}:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_rounds(singles: dict[str, Callable[[], object]], blocks: dict[str, Block], n: int, rounds: int,
               art: Callable[[int], dict[str, list[float]]] | None) -> dict[str, dict[str, list[float]]]:
    """Per round and variant: the median per-call seconds and the median paired overhead.

    Single-call variants run interleaved call by call (order rotated each time), and each call's
    overhead is taken against the plain call (A) made right beside it, so the drift of a shared,
    noisy machine cancels out. A block variant is timed against its baseline block beside it."""
    names = list(singles)
    for _ in range(WARMUP):
        for call in [*singles.values(), *(b.run for b in blocks.values()), *(b.run_baseline for b in blocks.values())]:
            call()
    per_round: dict[str, dict[str, list[float]]] = {"time": {}, "overhead": {}}
    for r in range(rounds):
        times: dict[str, list[float]] = {}
        overheads: dict[str, list[float]] = {}
        for i in range(n):
            order = names[i % len(names):] + names[:i % len(names)]
            measured = {name: timed(singles[name]) for name in order}
            for name in names:
                times.setdefault(name, []).append(measured[name])
                if name != names[0]:
                    overheads.setdefault(name, []).append(measured[name] - measured[names[0]])
        for name, block in blocks.items():
            for _ in range(max(1, n // block.calls)):
                base, seconds = timed(block.run_baseline) / block.calls, timed(block.run) / block.calls
                if block.baseline not in singles:  # a baseline of its own (G0): a row of its own
                    times.setdefault(block.baseline, []).append(base)
                times.setdefault(name, []).append(seconds)
                overheads.setdefault(name, []).append(seconds - base)
        if art is not None:
            measured_art = art(n)
            times["F0 ART venv: plain ainvoke"], times["F ART wrap_rollout/call"] = measured_art["plain"], measured_art["art"]
            overheads["F ART wrap_rollout/call"] = [a - p for a, p in zip(measured_art["art"], measured_art["plain"])]
        for kind, values in (("time", times), ("overhead", overheads)):
            for name, seconds in values.items():
                per_round[kind].setdefault(name, []).append(statistics.median(seconds))
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{name.split()[0]} {statistics.median(seconds) * 1e3:.2f} ms" for name, seconds in times.items()),
              flush=True)
    return per_round


def micro_us(base_url: str, model: str) -> dict[str, float]:
    """Client-side cost without HTTP: handler callbacks, and capture enter/close/assemble."""
    handler = ARTCallbackHandler(base_url=base_url)
    serialized = {"kwargs": {"openai_api_base": base_url}}
    params = {"model": model, "max_tokens": 4, "temperature": 0}
    reply = LLMResult(generations=[[ChatGeneration(message=AIMessage(content="Hi there!", id="chatcmpl-abc-0"),
                                                   generation_info={"finish_reason": "length"})]])
    copy_choice = exact_choice(ModelCall(endpoint=base_url, record_id=None, messages=[], response={}),
                               [1, 2, 3], [4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4])
    handler_s, capture_s = [], []
    for _ in range(MICRO_ITERATIONS):
        start = time.perf_counter()
        capture = art_capture()
        capture.__enter__()
        entered = time.perf_counter()
        run_id = uuid4()
        handler.on_chat_model_start(serialized, [[HumanMessage(PROMPT)]], run_id=run_id, invocation_params=params,
                                    metadata={"langgraph_node": "agent"})
        handler.on_llm_end(reply, run_id=run_id)
        recorded = time.perf_counter()
        # the transport's copy of the same call, which brings the tokens the handler's call is joined to
        record_call(ModelCall(endpoint=base_url, record_id="chatcmpl-abc-0", messages=[{"role": "user",
                              "content": PROMPT}], response={"role": "assistant", "content": "Hi there!"},
                              via_transport=True, choice=copy_choice), scope=capture.scope)
        capture._close()  # __exit__ minus fetch_tokens (there is no server behind these ids)
        assemble(capture.scope)
        handler_s.append(recorded - entered)
        capture_s.append(time.perf_counter() - recorded + entered - start)
    # outside any capture, what the transport's patched httpx send adds (an in-memory transport)
    client = httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    request = client.build_request("POST", f"{base_url}/chat/completions", json={})
    original: list[float] = []
    patched: list[float] = []
    for i in range(MICRO_ITERATIONS):  # interleaved, order alternated, as the calls above
        pair = [(original, lambda: httpx.Client.send.__wrapped__(client, request)),  # under our wrapper
                (patched, lambda: client.send(request))]
        for out, send in pair[::1 if i % 2 else -1]:
            out.append(timed(send))
    return {"handler_us": statistics.median(handler_s) * 1e6,
            "capture_no_fetch_us": statistics.median(capture_s) * 1e6,
            "transport_outside_us": (statistics.median(patched) - statistics.median(original)) * 1e6}


def summarize(per_round: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    """Median over rounds of each variant's time and paired overhead: against A for ours, against
    F0 (ART's venv, same process) for ART's."""
    rows: list[dict[str, object]] = []
    medians = {name: statistics.median(values) * 1e3 for name, values in per_round["time"].items()}
    for name, ms in sorted(medians.items()):
        baseline = medians[next(n for n in medians if n.split()[0] == BASELINES.get(name.split()[0], "A"))]
        is_baseline = name.split()[0] in ("A", *BASELINES.values())
        over = 0.0 if is_baseline else statistics.median(per_round["overhead"][name]) * 1e3
        limit = max(1.0, 0.02 * baseline)
        rows.append({"variant": name, "ms_per_call": ms, "overhead_ms": over, "overhead_pct": 100 * over / baseline,
                     "limit_ms": limit, "pass": None if is_baseline else over < limit})
    return rows


def print_report(rows: list[dict[str, object]], micro: dict[str, float], art: str, calls: int,
                 rounds: int) -> None:
    print(f"\n{'variant':<36} {'ms/call':>8} {'overhead ms':>12} {'overhead %':>11} {'target':>8}")
    for row in rows:
        verdict = "baseline" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
        print(f"{row['variant']:<36} {row['ms_per_call']:>8.2f} {row['overhead_ms']:>+12.2f} "
              f"{row['overhead_pct']:>+10.1f}% {verdict:>8}")
    limits = ", ".join(f"{str(r['variant']).split()[0]} {r['limit_ms']:.2f} ms" for r in rows if r["pass"] is not None)
    print(f"Medians of {rounds} round(s) x {calls} paired calls; target: overhead < max(1 ms, 2% of the "
          f"variant's baseline): {limits}.")
    print(f"Without HTTP: handler start+end {micro['handler_us']:.1f} us/call; capture enter+close+assemble "
          f"{micro['capture_no_fetch_us']:.1f} us/capture; outside a capture, the patched httpx send "
          f"{micro['transport_outside_us']:+.2f} us/request.")
    print(art)
    checked = [r for r in rows if r["pass"] is not None]
    failed = [str(r["variant"]).split()[0] for r in checked if not r["pass"]]
    print("Summary: " + ", ".join(f"{str(r['variant']).split()[0]} {r['overhead_ms']:+.2f} ms "
                                  f"({r['overhead_pct']:+.1f}%)" for r in checked)
          + (" -> all PASS" if not failed else f" -> FAIL: {', '.join(failed)}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--art-python", help="python of a venv with openpipe-art: adds ART's wrapper (F)")
    parser.add_argument("--model", default=TINY, help=f"served model: {TINY} (default: calls cost little, so the "
                        "overhead shows) or 'embedded' for SmolLM2-135M (calls as in real use)")
    args = parser.parse_args()
    art = (f"ART: art.langgraph from {args.art_python} (F: its overhead vs F0, measured in the same process)"
           if args.art_python else "ART: not measured (pass --art-python, a venv with openpipe-art)")
    # a backend given no model starts on the first model registered: name the embedded one's directory
    model = str(resolve_model_dir(None, BackendSettings().cache_dir)) if args.model == "embedded" else args.model
    with backend_server(model) as (base_url, served):
        print(f"Server {base_url} ({served}); {args.rounds} rounds x {args.calls} calls", flush=True)
        art_calls = (lambda n: run_art_script(args.art_python, base_url, served, n)) if args.art_python else None
        singles, blocks = build_variants(base_url, served)
        results = run_rounds(singles, blocks, args.calls, args.rounds, art_calls)
    micro = micro_us(base_url, served)
    rows = summarize(results)
    print_report(rows, micro, art, args.calls, args.rounds)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"calls": args.calls, "rounds": args.rounds, "rows": rows, "micro": micro, "art": art,
                       "rounds_ms": {kind: {k: [v * 1e3 for v in vs] for k, vs in values.items()}
                                     for kind, values in results.items()}}, out, indent=2)


if __name__ == "__main__":
    main()
