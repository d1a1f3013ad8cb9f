"""The vLLM engine and its trainer on a GPU, driven as a user drives them: `art-backend serve`
with the default `--engine auto` (which must pick vLLM), rollouts through the official `openai`
SDK, GRPO steps through `TrainableModel.train`, each new checkpoint hot-swapped in and served as
`<name>@N` before `train()` returns, while other requests keep arriving. Prints one line per
check and a table of what each part took; exits 1 if a check fails.

The reward is one a LoRA can learn on any base, even a randomly initialised one: the share of
sampled token ids that are even. Rewards of a group differ, so every group carries signal.

    python benchmarks/check_vllm_gpu.py --model DIR [--steps 3] [--json out.json]
    python benchmarks/check_vllm_gpu.py --random-model qwen2-1.5b --tokenizer DIR --model DIR
        (first builds a randomly initialised model of that shape with that tokenizer at DIR:
        no machine here reaches a model hub)

Run from the repository root, where vLLM, the backend and the client import.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_serving import print_aligned

from art_integrations import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

# Qwen2.5's shapes (its configs on the hub); the vocabulary is the given tokenizer's
SHAPES: dict[str, dict[str, int]] = {
    "qwen2-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                   "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                   "num_attention_heads": 12, "num_key_value_heads": 2},
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
                   "required": ["city"]}}}
FORECAST_SCHEMA = {"type": "object", "properties": {"rain": {"type": "boolean"},
                                                   "sky": {"type": "string", "enum": ["clear", "cloudy"]}},
                   "required": ["rain", "sky"], "additionalProperties": False}


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, name: str, ok: bool, detail: str = "") -> None:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}{f': {detail}' if detail else ''}", flush=True)
        if not ok:
            self.failed.append(name)


def build_random_model(shape: str, tokenizer_dir: Path, out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=32768, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, dtype="bfloat16", **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"Built a random {shape} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters) at {out}")


def even_share(token_ids: list[int]) -> float:
    return sum(1 for t in token_ids if t % 2 == 0) / max(1, len(token_ids))


async def api_checks(client: Any, model: str, check: Checks) -> None:
    user = [{"role": "user", "content": "What is the weather in Oslo?"}]
    forced = await client.chat.completions.create(
        model=model, messages=user, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=64,
        logprobs=True, extra_body={"return_token_ids": True})
    choice = forced.choices[0]
    calls = choice.message.tool_calls or []
    arguments = json.loads(calls[0].function.arguments) if calls else {}
    check("forced tool call parses", bool(calls) and arguments.get("city") in ("Paris", "Oslo", "Lima"),
          f"{[(c.function.name, c.function.arguments) for c in calls]}")
    ids = choice.model_extra["token_ids"]
    check("prompt and completion token ids, one logprob per completion token",
          bool(forced.model_extra.get("prompt_token_ids")) and len(ids) == len(choice.logprobs.content) > 0,
          f"{len(forced.model_extra.get('prompt_token_ids') or [])} prompt ids, {len(ids)} completion ids")

    asked = {"model": model, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 48,
             "temperature": 1.0, "seed": 7, "extra_body": {"return_token_ids": True}}
    whole = await client.chat.completions.create(**asked)
    streamed_ids: list[int] = []
    streamed_text = ""
    async for chunk in await client.chat.completions.create(**asked, stream=True):
        for streamed in chunk.choices:
            streamed_ids += (streamed.model_extra or {}).get("token_ids") or []
            streamed_text += streamed.delta.content or ""
    unstreamed = whole.choices[0]
    check("a stream's token ids and text equal the same seeded request's, not streamed",
          streamed_ids == unstreamed.model_extra["token_ids"] and streamed_text == unstreamed.message.content,
          f"{len(streamed_ids)} ids")

    several = await client.chat.completions.create(
        model=model, messages=user, n=4, temperature=1.0, max_tokens=16, extra_body={"return_token_ids": True})
    samples = [tuple(c.model_extra["token_ids"]) for c in several.choices]
    check("n=4 gives four different samples", len(samples) == 4 and len(set(samples)) > 1)

    shaped = await client.chat.completions.create(
        model=model, messages=user, temperature=1.0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST_SCHEMA}})
    content = shaped.choices[0].message.content or ""
    try:
        parsed = json.loads(content)
    except ValueError:
        parsed = None
    check("JSON-schema output parses and holds the schema's keys",
          isinstance(parsed, dict) and set(parsed) == {"rain", "sky"}, content[:80])


async def rollout_group(client: Any, model: str, prompt: str, rollouts: int, max_tokens: int) -> TrajectoryGroup:
    messages = [{"role": "user", "content": prompt}]
    response = await client.chat.completions.create(
        model=model, messages=messages, n=rollouts, temperature=1.0, max_tokens=max_tokens, logprobs=True,
        extra_body={"return_token_ids": True})
    trajectories = []
    for index, choice in enumerate(response.choices):
        trajectory = Trajectory(messages_and_choices=list(messages), reward=even_share(choice.model_extra["token_ids"]))
        trajectory.add_response(response, index)
        trajectories.append(trajectory)
    return TrajectoryGroup(trajectories=trajectories)


async def greedy_ids(client: Any, model: str) -> list[int]:
    response = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to ten."}], temperature=0, max_tokens=32,
        extra_body={"return_token_ids": True, "ignore_eos": True})
    return response.choices[0].model_extra["token_ids"]


async def train_and_swap(backend: LocalBackend, args: argparse.Namespace, check: Checks) -> list[dict[str, Any]]:
    model = TrainableModel(name="agent", project="gpu-check")
    await model.register(backend)
    client = model.openai_client()
    base = (await client.models.list()).data[0].id
    base_greedy = await greedy_ids(client, base)
    rows = []
    for _ in range(args.steps):
        step = await model.get_step()
        served = model.get_inference_name(step)
        started = time.perf_counter()
        groups = await asyncio.gather(*(rollout_group(client, served, f"Scenario {g}: say anything.", args.rollouts,
                                                      args.max_tokens) for g in range(args.groups)))
        rollout_seconds = time.perf_counter() - started
        # requests that arrive while the step trains: they wait (vLLM sleeps) and none fails
        during = [client.chat.completions.create(model=served, messages=[{"role": "user", "content": f"hi {i}"}],
                                                 max_tokens=8) for i in range(8)]
        started = time.perf_counter()
        result, *answers = await asyncio.gather(model.train(list(groups), TrainConfig(learning_rate=args.lr)),
                                                *during, return_exceptions=True)
        train_seconds = time.perf_counter() - started
        if isinstance(result, BaseException):
            raise result
        failed = [a for a in answers if isinstance(a, BaseException)]
        check(f"step {result.step}: 8 requests sent during the step all answered", not failed, repr(failed[:1]))
        newest_name = model.get_inference_name(result.step)
        listed = newest_name in {m.id for m in (await client.models.list()).data}
        started = time.perf_counter()
        newest = await greedy_ids(client, newest_name)
        first_answer = time.perf_counter() - started
        check(f"step {result.step}: served as {newest_name} as soon as train() returned", listed and len(newest) == 32)
        metrics = result.metrics
        rows.append({
            "step": result.step, "reward_mean": metrics["reward/mean"], "rollout_s": rollout_seconds,
            "train_call_s": train_seconds, "step_s": metrics["seconds"], "sleep_s": metrics.get("pause_seconds"),
            "wake_s": metrics.get("resume_seconds"), "commit_and_swap_s": train_seconds - metrics["seconds"],
            "first_answer_s": first_answer, "tokens": metrics["tokens/total"],
            "groups_trained": metrics["groups/trained"], "changed_from_base": newest != base_greedy})
    names = {m.id for m in (await client.models.list()).data}
    every_step = [f"agent@{s}" for s in range(1, args.steps + 1)]
    check("every step served by name", set(every_step) <= names and "agent" in names, ", ".join(sorted(names)))
    check("the trained LoRA changes the greedy output", any(row["changed_from_base"] for row in rows))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("step", "reward_mean", "rollout_s", "train_call_s", "step_s", "sleep_s", "wake_s", "commit_and_swap_s",
              "first_answer_s", "tokens", "groups_trained")
    print_aligned(header, [tuple(f"{row[k]:.3f}" if isinstance(row[k], float) else str(row[k]) for k in header)
                           for row in rows])


async def main_async(args: argparse.Namespace) -> int:
    check = Checks()
    art_dir = Path(tempfile.mkdtemp(prefix="gpu-check-art-"))
    log = art_dir / "backend.log"
    started = time.perf_counter()
    backend = LocalBackend(in_process=False, model=str(args.model), art_dir=art_dir, log_file=log)
    startup = time.perf_counter() - started
    try:
        chosen = [line for line in log.read_text(errors="replace").splitlines() if "Engine:" in line]
        check("--engine auto picks vLLM on a GPU", any("vllm" in line for line in chosen), chosen[-1] if chosen else "")
        client = backend.openai_client()
        await api_checks(client, (await client.models.list()).data[0].id, check)
        rows = await train_and_swap(backend, args, check)
    finally:
        await backend.close()
    print(f"\nBackend up in {startup:.1f} s (vLLM start, the trainer's copy of the weights, CUDA graphs). Per step "
          f"({args.groups} groups x {args.rollouts} rollouts of {args.max_tokens} tokens, lr {args.lr}):")
    print_table(rows)
    print(f"Summary: {len(check.failed)} check(s) failed{': ' + ', '.join(check.failed) if check.failed else ''}; "
          f"median step {statistics.median(r['step_s'] for r in rows):.2f} s, median commit + hot-swap "
          f"{statistics.median(r['commit_and_swap_s'] for r in rows):.2f} s; reward {rows[0]['reward_mean']:.3f} -> "
          f"{rows[-1]['reward_mean']:.3f}; log {log}")
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(args.model), "startup_s": startup, "rows": rows,
                                         "failed": check.failed}, indent=2))
    return 1 if check.failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a local model directory (built first with "
                                                                  "--random-model)")
    parser.add_argument("--random-model", choices=sorted(SHAPES), help="build a random-init model of this shape")
    parser.add_argument("--tokenizer", type=Path, help="the tokenizer directory for --random-model")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.random_model:
        if args.tokenizer is None:
            parser.error("--random-model needs --tokenizer DIR (a directory with the tokenizer's files)")
        build_random_model(args.random_model, args.tokenizer, args.model)
    sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
