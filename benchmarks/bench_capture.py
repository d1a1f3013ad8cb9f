"""Per-call overhead of trajectory capture against a plain `ChatOpenAI` call to the same server.

A real `python -m art_backend serve --model tiny-random-smollm2` subprocess (its own process, so
it never shares the GIL with the client being timed) answers every variant; each call is a
sequential `llm.invoke(PROMPT)` with max_tokens=4, temperature=0:
  A  plain ChatOpenAI (baseline, no capture)
  B  plain ChatOpenAI + extra_body={"return_token_ids": True} (server-side token recording)
  C  ChatART, one `with art_capture():` per call (incl. the exit-time POST /v1/art/token_records)
  D  ChatART, 10 calls per capture (token fetch batched per capture)
  E  ChatOpenAI + return_token_ids + config={"callbacks": [ARTCallbackHandler()]}, capture per call
After a warm-up, each round runs every variant (order rotated per round); a round's value is
the median per-call time (D: per-capture time / 10); reported is the median over rounds, and
PASS when the overhead vs A < max(1 ms, 2% of A). Also timed without HTTP (us): the handler's
on_chat_model_start + on_llm_end on a fake reply, and a capture's enter + close + `assemble()`
(all but the token fetch). C makes no request of its own: ChatART hands the tokens over with the
reply; E fetches them on capture exit (one POST per capture).

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
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from uuid import uuid4

import httpx
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.outputs import ChatGeneration, LLMResult
from langchain_openai import ChatOpenAI

from art_integrations import LocalBackend
from art_integrations.capture import art_capture, assemble
from art_integrations.langchain.callback import ARTCallbackHandler
from art_integrations.langchain.chat_model import ChatART

TINY = "tiny-random-smollm2"
PROMPT = "Say hello."
WARMUP = 5
PER_SCOPE_D = 10
MICRO_ITERATIONS = 2000
ART_SCRIPT = Path(__file__).with_name("art_langgraph_calls.py")
Variant = Callable[[int], list[float]]  # runs n calls, returns per-call seconds


@contextmanager
def backend_server(model: str | None) -> Iterator[tuple[str, str]]:
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


def build_variants(base_url: str, model: str) -> dict[str, Variant]:
    common = {"model": model, "base_url": base_url, "api_key": "unused", "max_tokens": 4, "temperature": 0}
    plain, tokens = ChatOpenAI(**common), ChatOpenAI(**common, extra_body={"return_token_ids": True})
    art, handler = ChatART(**common), ARTCallbackHandler()
    config = {"callbacks": [handler]}

    def per_call(fn: Callable[[], object]) -> Variant:
        return lambda n: [timed(fn) for _ in range(n)]

    def batched(n: int) -> list[float]:
        scopes = max(1, n // PER_SCOPE_D)
        return [timed(lambda: checked_capture(lambda: [art.invoke(PROMPT) for _ in range(PER_SCOPE_D)],
                                              PER_SCOPE_D)) / PER_SCOPE_D for _ in range(scopes)]

    return {
        "A plain ChatOpenAI": per_call(lambda: plain.invoke(PROMPT)),
        "B + return_token_ids": per_call(lambda: tokens.invoke(PROMPT)),
        "C ChatART, capture/call": per_call(lambda: checked_capture(lambda: art.invoke(PROMPT), 1)),
        f"D ChatART, {PER_SCOPE_D} calls/capture": batched,
        "E handler, capture/call": per_call(
            lambda: checked_capture(lambda: tokens.invoke(PROMPT, config=config), 1)),  # type: ignore[arg-type]
    }


def art_variants(art_python: str, base_url: str, model: str) -> dict[str, Variant]:
    """F0/F from one run of the ART script per round (both measured in its own process)."""
    last: dict[str, list[float]] = {}

    def run(n: int) -> dict[str, list[float]]:
        out = subprocess.run([art_python, str(ART_SCRIPT), base_url, model, str(n)], capture_output=True,
                             text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{ART_SCRIPT.name} failed under {art_python}:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    def plain(n: int) -> list[float]:
        last.update(run(n))
        return last["plain"]

    return {"F0 ART venv: plain ainvoke": plain, "F ART wrap_rollout/call": lambda n: last["art"]}


def run_rounds(variants: dict[str, Variant], calls: int, rounds: int) -> dict[str, list[float]]:
    """Per variant, the median per-call seconds of each round; order rotated every round (F0 and F
    are measured together, so they move as one)."""
    names = list(variants)
    ours = [n for n in names if not n.startswith("F")]
    for name in ours:
        variants[name](WARMUP if not name.startswith("D") else PER_SCOPE_D)
    results: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        order = ours[r % len(ours):] + ours[:r % len(ours)] + [n for n in names if n.startswith("F")]
        for name in order:
            results[name].append(statistics.median(variants[name](calls)))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{n.split()[0]} {results[n][-1] * 1e3:.2f} ms" for n in names),
              flush=True)
    return results


def micro_us(base_url: str, model: str) -> dict[str, float]:
    """Client-side cost without HTTP: handler callbacks, and capture enter/close/assemble."""
    handler = ARTCallbackHandler(base_url=base_url)
    serialized = {"kwargs": {"openai_api_base": base_url}}
    params = {"model": model, "max_tokens": 4, "temperature": 0}
    reply = LLMResult(generations=[[ChatGeneration(message=AIMessage(content="Hi there!", id="chatcmpl-abc-0"),
                                                   generation_info={"finish_reason": "length"})]])
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
        capture._close()  # __exit__ minus fetch_tokens (there is no server behind these ids)
        assemble(capture.scope)
        handler_s.append(recorded - entered)
        capture_s.append(time.perf_counter() - recorded + entered - start)
    return {"handler_us": statistics.median(handler_s) * 1e6,
            "capture_no_fetch_us": statistics.median(capture_s) * 1e6}


def summarize(results: dict[str, list[float]]) -> list[dict[str, object]]:
    """Overhead of each variant against its baseline: A for ours, F0 (same venv) for ART's."""
    medians = {name: statistics.median(values) * 1e3 for name, values in results.items()}
    rows: list[dict[str, object]] = []
    for name, ms in medians.items():
        baseline = next(m for n, m in medians.items() if n.startswith("F0" if name.startswith("F") else "A"))
        over, limit = ms - baseline, max(1.0, 0.02 * baseline)
        is_baseline = name.split()[0] in ("A", "F0")
        rows.append({"variant": name, "ms_per_call": ms, "overhead_ms": over, "overhead_pct": 100 * over / baseline,
                     "limit_ms": limit, "pass": None if is_baseline else over < limit})
    return rows


def print_report(rows: list[dict[str, object]], micro: dict[str, float], art: str, calls: int,
                 rounds: int) -> None:
    print(f"\n{'variant':<28} {'ms/call':>8} {'overhead ms':>12} {'overhead %':>11} {'target':>8}")
    for row in rows:
        verdict = "baseline" if row["pass"] is None else ("PASS" if row["pass"] else "FAIL")
        print(f"{row['variant']:<28} {row['ms_per_call']:>8.2f} {row['overhead_ms']:>+12.2f} "
              f"{row['overhead_pct']:>+10.1f}% {verdict:>8}")
    print(f"Medians of {rounds} round(s) x {calls} calls; target: overhead < {rows[0]['limit_ms']:.2f} ms "
          "(max of 1 ms and 2% of A).")
    print(f"Without HTTP: handler start+end {micro['handler_us']:.1f} us/call; capture enter+close+assemble "
          f"{micro['capture_no_fetch_us']:.1f} us/capture.")
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
    with backend_server(None if args.model == "embedded" else args.model) as (base_url, served):
        print(f"Server {base_url} ({served}); {args.rounds} rounds x {args.calls} calls", flush=True)
        variants = build_variants(base_url, served)
        if args.art_python:
            variants.update(art_variants(args.art_python, base_url, served))
        results = run_rounds(variants, args.calls, args.rounds)
    micro = micro_us(base_url, served)
    rows = summarize(results)
    print_report(rows, micro, art, args.calls, args.rounds)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"calls": args.calls, "rounds": args.rounds, "rows": rows, "micro": micro, "art": art,
                       "rounds_ms": {k: [v * 1e3 for v in vs] for k, vs in results.items()}}, out, indent=2)


if __name__ == "__main__":
    main()
