"""Greedy tokens of one checkpoint from several runtimes, and how far they agree with the backend's.

The backend serving `name@N` is the reference: its greedy tokens for each prompt, with the margin
at each position between its first choice and the next (from `top_logprobs`). Every runtime is
given the same prompt token ids (the backend's rendering of the chat) and decodes greedily until
its end-of-turn token or `new_tokens`. Runtimes compute in other orders and precisions, so where
the reference's top two are nearly tied a rounding difference may pick the other one, and from
there the continuations differ: a divergence is counted as a near tie when the reference's margin
there is under `tie` nats, and as a disagreement otherwise. Used by tests/test_export.py and
benchmarks/bench_export.py.
"""

from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a LoRA adapter is in one sentence.",
    "Say hello in Spanish.",
    "What is 12 times 7?",
    "Name a colour of the rainbow.",
    "Give me a word that rhymes with cat.",
]


@dataclass
class Reference:
    prompt_ids: list[int]
    tokens: list[int]
    margins: list[float]  # nats between the first choice and the second, at each position


@dataclass
class Agreement:
    prompts: int
    identical: int  # prompts whose tokens all agree
    tokens: int  # reference tokens
    agreed: int  # tokens agreeing before each prompt's first divergence
    near_ties: int  # divergences where the reference's margin was under the tie threshold
    disagreements: list[str]  # divergences at a clear margin: (prompt, position, margin, tokens)

    def row(self) -> str:
        return (f"{self.identical}/{self.prompts} identical, {self.agreed}/{self.tokens} tokens before a divergence, "
                f"{self.near_ties} at near ties, {len(self.disagreements)} at a clear margin")


async def backend_greedy(client: Any, model: str, prompts: list[str], new_tokens: int) -> list[Reference]:
    """The backend's greedy tokens for each chat prompt, with their margins."""
    references = []
    for prompt in prompts:
        response = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=new_tokens, temperature=0,
            logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True})
        choice = response.choices[0]
        margins = []
        for position in choice.logprobs.content:
            others = sorted((t.logprob for t in position.top_logprobs), reverse=True)
            margins.append(others[0] - others[1] if len(others) > 1 else float("inf"))
        references.append(Reference(response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                                    margins))
    return references


def agreement(references: list[Reference], others: list[list[int]], stop_ids: set[int], tie: float) -> Agreement:
    """How far `others` (one token list per prompt) agree with `references` (see the module's docstring)."""
    result = Agreement(len(references), 0, 0, 0, 0, [])
    for number, (reference, other) in enumerate(zip(references, others)):
        expected = _until_stop(reference.tokens, stop_ids)
        got = _until_stop(other, stop_ids)
        result.tokens += len(expected)
        common = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        result.agreed += common
        if expected == got:
            result.identical += 1
        elif common < len(expected) and common < len(got) and reference.margins[common] < tie:
            result.near_ties += 1
        else:
            margin = reference.margins[common] if common < len(expected) else float("nan")
            result.disagreements.append(f"prompt {number}, position {common}: margin {margin:.4f} nats, backend "
                                        f"{expected[common:common + 4]}, other {got[common:common + 4]}")
    return result


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    end = next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
    return list(tokens[:end])


def transformers_greedy(model_dir: Path, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' `generate`, greedy, on a model directory (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompt_ids:
            generated = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            outputs.append(generated[0, len(ids):].tolist())
    return outputs


def llama_server_greedy(url: str, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """llama.cpp's server (/completion with token ids), greedy (top-k 1)."""
    outputs = []
    for ids in prompt_ids:
        body = {"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1, "return_tokens": True,
                "cache_prompt": False}
        request = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as response:
            outputs.append(json.loads(response.read())["tokens"])
    return outputs


def vllm_greedy(llm: Any, prompt_ids: list[list[int]], new_tokens: int, lora: Any = None) -> list[list[int]]:
    """vLLM's offline `LLM.generate`, greedy, optionally through a `LoRARequest`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids],
                           SamplingParams(temperature=0.0, max_tokens=new_tokens), lora_request=lora, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]
