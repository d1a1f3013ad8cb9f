"""The embedded engine against transformers itself: same logits, same LoRA, real batching."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.cpp_extension
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

from art_backend.engine.base import GenerationRequest, SamplingParams
from art_backend.engine.cpu_kernels import (build_directory, cannot_build, compiler, load_cpu_kernels,
                                           openmp_refused, vector_build)
from art_backend.engine.exact_groups import as_exact_groups
from art_backend.engine.kv_cache import KV_GROWTH_TOKENS, KVCache
from art_backend.engine.llama import LORA_TARGETS, PROJECTIONS, LeanLlama, LoraWeights
from art_backend.engine.sampling import RowSampling, gumbel_argmax, sample
from art_backend.engine.torch_engine import TorchEngine
from art_backend.errors import ModelNotServedError
from tests.conftest import random_adapter


def _prompt(engine: TorchEngine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=False)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


async def _run(engine: TorchEngine, request: GenerationRequest) -> dict[int, dict]:
    out: dict[int, dict] = {}
    async for delta in engine.generate(request):
        seq = out.setdefault(delta.index, {"ids": [], "logprobs": [], "text": "", "finish": None})
        seq["ids"] += delta.token_ids
        seq["logprobs"] += [lp.logprob for lp in delta.logprobs]
        seq["text"] += delta.text
        seq["finish"] = delta.finish_reason or seq["finish"]
    return out


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "embedded_model_dir"])
def test_lean_forward_matches_transformers(model_fixture: str, request: pytest.FixtureRequest) -> None:
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_fixture)).eval()
    lean = LeanLlama(model, max_len=256)
    qkv = lean.linears[0]["qkv"]  # the fast layout is the one tested
    if model_fixture == "embedded_model_dir" and _exact_groups_apply(lean):
        assert qkv.groups is not None and qkv.groups.bits == 4 and lean.lm_head.groups is not None
    else:
        assert qkv.packed == torch.backends.mkldnn.is_available()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        reference = model(ids).logits
        reference_next = model(torch.cat([ids, ids[:, :1]], dim=1)).logits[:, -1]
    cache = lean.new_cache()
    cache.reserve(2, 16)
    slots, positions = torch.arange(2), torch.arange(12)[None].expand(2, 12)
    prefill = lean.logits(lean.forward(ids, positions, slots, cache, torch.tensor([12, 12])))
    step = lean.logits(lean.forward(ids[:, :1], torch.tensor([[12], [12]]), slots, cache, torch.tensor([13, 13])))
    # oneDNN's packed matmuls sum in another order than transformers' MKL path: fp32 rounding
    # differences, ~5e-4 at most on the embedded model's logits (magnitude ~20) after 30 layers
    torch.testing.assert_close(prefill, reference, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(step[:, 0], reference_next, atol=1e-3, rtol=1e-4)


def _kernels_cannot_build() -> str | None:
    return cannot_build() or openmp_refused(compiler())


def _kernels_or_skip() -> Any:
    """The fused CPU kernels; where they can be built (a compiler with OpenMP, ninja) they must build,
    elsewhere the test skips, saying why."""
    kernels = load_cpu_kernels()
    if kernels is None:
        reason = _kernels_cannot_build()
        assert reason is not None, "the fused kernels did not build although this machine can build them"
        pytest.skip(f"the fused kernels cannot be built here: {reason}")
    return kernels


def _exact_groups_apply(lean: LeanLlama) -> bool:
    """Whether `lean` may serve exact integer groups here; where the kernels can be built, they must."""
    if lean.kernels is None:
        assert _kernels_cannot_build() is not None, "the fused kernels did not build although they can be here"
    return lean.kernels is not None and vector_build()


def test_exact_integer_groups_are_found_and_multiply_as_the_float32_weights(embedded_model_dir: Path) -> None:
    kernels = _kernels_or_skip()
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir).eval()
    gate = model.model.layers[3].mlp.gate_proj.weight.detach()  # GGUF Q4_1
    embedding = model.get_output_embeddings().weight.detach()  # GGUF Q8_0
    for weight, bits in ((gate, 4), (embedding, 8)):
        groups = as_exact_groups(weight)
        assert groups is not None and groups.bits == bits
        # the codes, scales and offsets give back every float32 weight exactly
        codes = groups.codes.transpose(1, 2).reshape(weight.shape[0], -1).long()
        if bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).reshape(weight.shape)
        scales, offsets = (t.float().transpose(1, 2).reshape(weight.shape[0], -1, 1) for t in (groups.scales, groups.offsets))
        rebuilt = (codes.reshape(weight.shape[0], -1, 32) * scales + offsets).reshape(weight.shape)
        assert torch.equal(rebuilt, weight)
        torch.manual_seed(0)
        bias = torch.randn(weight.shape[0])
        for rows in (1, 3, 16, 21):  # every block size of the kernel: 16 (AVX-512), 8, 4, 2, 1
            x = torch.randn(rows, weight.shape[1])
            got = kernels.linear_groups(x, groups.codes, groups.scales, groups.offsets, bias, groups.bits)
            want = (x.double() @ weight.double().T + bias.double()).float()
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    nudged = gate.clone()
    nudged[5, 7] = torch.nextafter(nudged[5, 7], torch.tensor(1.0))  # one weight off the grid by one ulp
    assert as_exact_groups(nudged) is None
    assert as_exact_groups(torch.randn(64, 64)) is None  # a model trained in float32


def _attention_in_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `decode_attention` computes, step by step in float64: the output and the keys cache."""
    def rotate(x: torch.Tensor, row: int) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos[row] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[row]

    k_cache = k_cache.double()
    v_cache = v_cache.double()
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
        k_cache[slot, :, position] = rotate(k[row].double(), row)
        v_cache[slot, :, position] = v[row].double()
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, (slot, position) in enumerate(zip(slots.tolist(), positions.tolist())):
        queries = rotate(q[row].double(), row) / dim ** 0.5
        for head in range(heads):
            kv = head // (heads // kv_heads)
            weights = torch.softmax(k_cache[slot, kv, :position + 1] @ queries[head], dim=0)
            out[row, head] = weights @ v_cache[slot, kv, :position + 1]
    return out, k_cache


def _decode_inputs(rows: int, heads: int, kv_heads: int, dim: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random q, k, v of one decode step and the rotary cos and sin of each row's position."""
    q, k, v = (torch.randn(rows, n, dim, generator=generator) for n in (heads, kv_heads, kv_heads))
    angles = torch.randn(rows, dim // 2, generator=generator)
    return q, k, v, torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)


# head sizes of 16 to 128 take the vector path (its 16-key blocks, its last partial block, 1 to
# 12 queries weighed at once); 48 takes the portable loops
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 2, 16), (14, 2, 64), (16, 8, 128),
                                                        (6, 2, 32), (5, 5, 48)])
def test_decode_attention_matches_attention_in_float64(heads: int, kv_heads: int, dim: int) -> None:
    kernels = _kernels_or_skip()
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 15, 16, 17, 46, 100, 5, 6, 7])  # the last three: one prompt's rows in one slot
    slots = torch.tensor([1, 3, 0, 2, 5, 7, 4, 4, 4])
    rows = len(positions)
    k_cache = torch.randn(8, kv_heads, 128, dim, generator=generator)
    v_cache = torch.randn(8, kv_heads, 128, dim, generator=generator)
    q, k, v, cos, sin = _decode_inputs(rows, heads, kv_heads, dim, generator)
    want, want_keys = _attention_in_float64(q, k, v, cos, sin, k_cache, v_cache, slots, positions)
    got = kernels.decode_attention(q, k, v, cos, sin, k_cache, v_cache, slots, positions)
    torch.testing.assert_close(got, want.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(k_cache, want_keys.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (6, 2, 32), (5, 5, 48)])
def test_decode_attention_reads_a_shared_start_as_its_own_copy_to_the_bit(heads: int, kv_heads: int, dim: int) -> None:
    # every slot holds the same first 90 keys and values; reading them from slot 0, or from the
    # row's own slot through the shared path, must give the bits of reading them as the row's own
    # (GCC once split the loop over keys at the shared length and vectorized the halves apart)
    kernels = _kernels_or_skip()
    generator = torch.Generator().manual_seed(1)
    rows, shared = 4, 90
    k_cache = torch.randn(1, kv_heads, 128, dim, generator=generator).repeat(rows, 1, 1, 1)
    v_cache = torch.randn(1, kv_heads, 128, dim, generator=generator).repeat(rows, 1, 1, 1)
    k_cache[1:, :, shared:] = torch.randn(rows - 1, kv_heads, 128 - shared, dim, generator=generator)
    v_cache[1:, :, shared:] = torch.randn(rows - 1, kv_heads, 128 - shared, dim, generator=generator)
    q, k, v, cos, sin = _decode_inputs(rows, heads, kv_heads, dim, generator)
    slots, positions = torch.arange(rows), torch.tensor([101, 103, 99, 100])
    lengths = torch.tensor([0] + [shared] * (rows - 1))

    def attend(*shared_kv: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention(q, k, v, cos, sin, k_cache.clone(), v_cache.clone(), slots, positions,
                                        *shared_kv)

    own = attend()
    assert torch.equal(attend(torch.zeros(rows, dtype=torch.long), lengths), own)  # from the leader's slot
    assert torch.equal(attend(slots.clone(), lengths), own)  # the row's own slot, through the shared path


def _random_lora(lean: LeanLlama, modules: list[str], seed: int) -> LoraWeights:
    """Random rank-4 A and B for `modules` in every layer, fused as `TorchEngine` fuses a peft adapter."""
    generator = torch.Generator().manual_seed(seed)
    a, b = {}, {}
    for layer, linears in enumerate(lean._modules):
        for projection, names in PROJECTIONS.items():
            for name, module in zip(names, linears[projection]):
                if name in modules:
                    a[(layer, name)] = torch.randn(4, module.in_features, generator=generator) * 0.1
                    b[(layer, name)] = torch.randn(module.out_features, 4, generator=generator) * 0.1
    return lean.fuse_lora(a, b)


def _qwen3_tiny() -> torch.nn.Module:
    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "qwen3 (q/k norms)"])
def test_fused_decode_kernels_match_the_eager_ops(model_fixture: str, request: pytest.FixtureRequest) -> None:
    if model_fixture.startswith("qwen3"):
        model = _qwen3_tiny()
    else:
        model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_fixture)).eval()
    fused, eager = LeanLlama(model, max_len=64), LeanLlama(model, max_len=64, fused_kernels=False)
    if shutil.which("c++"):  # where a compiler exists, the kernels must build: the fast path is the one tested
        assert fused.kernels is not None
    else:
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    adapters = [_random_lora(fused, ["q_proj", "v_proj", "down_proj"], seed=1), _random_lora(fused, ["o_proj"], seed=2)]
    torch.manual_seed(0)
    caches = [fused.new_cache(), eager.new_cache()]
    for cache in caches:
        cache.reserve(8, 32)
    # four rows of different lengths in scattered slots, two adapters and the base model mixed
    lengths = torch.tensor([5, 9, 3, 12])
    slots, lora = torch.tensor([6, 1, 3, 0]), [adapters[0], None, adapters[1], adapters[0]]
    for row, (slot, length) in enumerate(zip(slots.tolist(), lengths.tolist())):
        ids = torch.randint(0, model.config.vocab_size, (1, length))
        for lean, cache in zip((fused, eager), caches):  # multi-token calls use the eager ops in both
            lean.forward(ids, torch.arange(length)[None], torch.tensor([slot]), cache, torch.tensor([length]),
                         [lora[row]])
    for _ in range(4):
        tokens = torch.randint(0, model.config.vocab_size, (4, 1))
        got, want = (lean.forward(tokens, lengths[:, None], slots, cache, lengths + 1, lora)
                     for lean, cache in zip((fused, eager), caches))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
        lengths = lengths + 1
    torch.testing.assert_close(caches[0].k, caches[1].k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(caches[0].v, caches[1].v, atol=1e-5, rtol=1e-4)


def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(embedded_model_dir: Path) -> None:
    # continuous batching puts a sequence beside whichever requests run at that moment, and
    # whether a prompt's start is already cached depends on timing, so a seed repeats only if
    # each token's numbers come out bit for bit the same in any batch and by any path (#33)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir).eval()
    lean = LeanLlama(model, max_len=64)
    if not _exact_groups_apply(lean):
        pytest.skip("exact integer groups need the kernels' AVX2 or AVX-512 build")
    modules = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    adapter, other = _random_lora(lean, modules, seed=1), _random_lora(lean, ["up_proj"], seed=2)
    torch.manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (5, 10))
    lora = [adapter, None, other, adapter, adapter]
    alone, together = lean.new_cache(), lean.new_cache()
    alone.reserve(1, 16)
    together.reserve(5, 16)
    positions = torch.arange(10)[None]
    first = lean.forward(prompts[:1], positions, torch.tensor([0]), alone, torch.tensor([10]), lora[:1])
    pair = lean.forward(prompts[:2], positions.expand(2, 10), torch.arange(2), together, torch.tensor([10, 10]),
                        lora[:2])
    assert torch.equal(first[0], pair[0])  # a prompt's prefill beside another prompt
    for row in range(2, 5):
        lean.forward(prompts[row:row + 1], positions, torch.tensor([row]), together, torch.tensor([10]), [lora[row]])
    tokens = torch.randint(0, model.config.vocab_size, (5, 1))
    for step in range(10, 12):  # decode steps: one row, then five rows with two adapters and the base model
        one = lean.logits(lean.forward(tokens[:1], torch.tensor([[step]]), torch.tensor([0]), alone,
                                       torch.tensor([step + 1]), lora[:1]))
        five = lean.logits(lean.forward(tokens, torch.full((5, 1), step), torch.arange(5), together,
                                        torch.full((5,), step + 1), lora))
        assert torch.equal(one[0], five[0])
        tokens = five[:, -1].argmax(dim=-1, keepdim=True)
    # a token's numbers, whether it came in a prompt, after a cached prefix or in a decode step
    whole, chunked = lean.new_cache(), lean.new_cache()
    whole.reserve(1, 16)
    chunked.reserve(1, 16)
    sequence = torch.cat([prompts[:1], torch.randint(0, model.config.vocab_size, (1, 2))], dim=1)
    at_once = lean.forward(sequence, torch.arange(12)[None], torch.tensor([0]), whole, torch.tensor([12]), lora[:1])
    pieces = [lean.forward(sequence[:, a:b], torch.arange(a, b)[None], torch.tensor([0]), chunked, torch.tensor([b]),
                           lora[:1]) for a, b in ((0, 6), (6, 11), (11, 12))]
    assert torch.equal(at_once, torch.cat(pieces, dim=1))


def test_fused_sampling_draws_what_the_torch_sampler_draws() -> None:
    kernels = _kernels_or_skip()
    torch.manual_seed(0)
    logits = torch.randn(64, 49152) * 4  # the embedded model's vocabulary, peaked rows

    def rows() -> list[RowSampling]:  # greedy and three temperatures; each row seeded alike for both samplers
        return [RowSampling(t, 1.0, 0, torch.Generator().manual_seed(i)) for i, t in enumerate([0.0, 0.5, 1.0, 1.5] * 16)]

    fused, plain = sample(logits, rows(), kernels=kernels), sample(logits, rows())
    assert fused.token_ids == plain.token_ids
    # float32 log-sum-exps over 49,152 logits summed in another order: 1.6e-5 apart seen on an AMD EPYC
    assert fused.logprobs == pytest.approx(plain.logprobs, abs=1e-4)
    assert len(set(fused.token_ids[1::4])) > 8  # sampled rows really draw (not all argmax)



def test_the_gumbel_kernel_draws_what_the_torch_reference_draws() -> None:
    kernels = _kernels_or_skip()
    torch.manual_seed(0)
    for vocab in (5, 49152):
        scaled = torch.randn(48, vocab) * 4
        scaled[::3, vocab // 2:] = float("-inf")  # rows under a grammar
        seeds = torch.randint(0, 2**31, (48,))
        drawn = kernels.gumbel_argmax(scaled, seeds)
        assert torch.equal(drawn, gumbel_argmax(scaled, seeds))
        assert bool((drawn[::3] < vocab // 2).all())
        assert len(set(drawn.tolist())) > 2


def test_the_gumbel_draw_samples_the_softmax() -> None:
    torch.manual_seed(0)
    scaled = torch.randn(10) * 1.5
    draws = 100_000
    drawn = gumbel_argmax(scaled.expand(draws, 10), torch.arange(draws) * 7 + 13)
    frequencies = torch.bincount(drawn, minlength=10) / draws
    assert float((frequencies - scaled.softmax(dim=-1)).abs().max()) < 0.01


def test_a_rows_draw_does_not_depend_on_what_the_rows_beside_it_ask_for() -> None:
    # a grammar, top-p or top logprobs in one row must not send its neighbours another way round
    kernels = _kernels_or_skip()
    torch.manual_seed(0)
    logits = torch.randn(4, 49152) * 4

    def row(seed: int, top_p: float = 1.0, top_logprobs: int = 0) -> RowSampling:
        return RowSampling(1.0, top_p, top_logprobs, torch.Generator().manual_seed(seed))

    alone = sample(logits[:1], [row(0)], kernels=kernels)
    allowed = torch.ones(4, 49152, dtype=torch.bool)
    allowed[1, 100:] = False  # row 1's grammar allows 100 tokens
    beside = sample(logits, [row(0), row(1), row(2, top_p=0.9), row(3, top_logprobs=3)], allowed, kernels=kernels)
    assert (beside.token_ids[0], beside.logprobs[0]) == (alone.token_ids[0], alone.logprobs[0])
    assert beside.token_ids[1] < 100 and len(beside.top[3]) == 3 and beside.top[0] == []


def _without_kernels(tiny_model_dir: Path) -> LeanLlama:
    """The tiny model's LeanLlama from a fresh attempt at the kernels (the cached one put back after)."""
    load_cpu_kernels.cache_clear()
    try:
        return LeanLlama(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), max_len=32)
    finally:
        load_cpu_kernels.cache_clear()


def _decodes_eagerly(lean: LeanLlama) -> None:
    assert lean.kernels is None
    cache = lean.new_cache()
    hidden = lean.forward(torch.tensor([[1], [2]]), torch.tensor([[0], [0]]), torch.arange(2), cache, torch.tensor([1, 1]))
    assert hidden.shape == (2, 1, lean.config.hidden_size)


def test_a_failed_kernel_build_says_the_compilers_first_error_and_decodes_eagerly(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if _kernels_cannot_build() is not None:
        pytest.skip(f"no build is tried here: {_kernels_cannot_build()}")

    def failing_build(*args: Any, **kwargs: Any) -> None:  # what torch's builder raises, its log inside
        raise RuntimeError("Error building extension 'art_cpu_kernels_avx2': [1/3] c++ -MMD -MF cpu_kernels.o.d "
                           "-O3 -c cpu_kernels.cpp -o cpu_kernels.o\nFAILED: cpu_kernels.o\ncpu_kernels.cpp: In "
                           "function 'float {anonymous}::exp_approx(float)':\ncpu_kernels.cpp:50:19: error: "
                           "'bit_cast' is not a member of 'std'\nninja: build stopped: subcommand failed.")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_build)
    _decodes_eagerly(_without_kernels(tiny_model_dir))
    assert "The compiler said: cpu_kernels.cpp:50:19: error: 'bit_cast' is not a member of 'std'" in caplog.text
    assert "Install" not in caplog.text  # a compiler is installed: the warning must not say to install one


def test_no_compiler_or_one_without_openmp_is_named_before_any_build(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a build was attempted")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_build)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    _decodes_eagerly(_without_kernels(tiny_model_dir))
    assert f"no C++ compiler: '{tmp_path / 'no-such-compiler'}' is not on PATH. Install one with OpenMP" in caplog.text

    caplog.clear()
    apple_clang = tmp_path / "clang++"  # as Apple's clang answers -fopenmp
    apple_clang.write_text("#!/bin/sh\necho \"clang: error: unsupported option '-fopenmp'\" >&2\nexit 1\n")
    apple_clang.chmod(0o755)
    monkeypatch.setenv("CXX", str(apple_clang))
    _decodes_eagerly(_without_kernels(tiny_model_dir))
    assert (f"{apple_clang} has no OpenMP (clang: error: unsupported option '-fopenmp'), which the kernels' threads "
            "need") in caplog.text


def test_a_kernel_build_killed_while_locked_does_not_hang_the_next_start(tmp_path: Path) -> None:
    """torch's builder waits forever on a `lock` file; one left by a killed build is removed, with a warning."""
    _kernels_or_skip()
    name = f"art_cpu_kernels_{torch.backends.cpu.get_cpu_capability().lower()}"
    copy = tmp_path / name
    shutil.copytree(build_directory(name), copy)  # the cached build (mtimes kept: loaded, not rebuilt)
    (copy / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from art_backend.engine.cpu_kernels import load_cpu_kernels\n"
                               "assert load_cpu_kernels() is not None"],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert "was killed while holding it" in loaded.stderr and not (copy / "lock").exists()


# A passage of ordinary prose (75 tokens): the bf16 check needs many positions, and positions where
# the next token is clear as well as near-ties, to be the same test on every CPU.
_PROSE = ("The river ran past the old mill, where the miller's daughter counted sacks of flour each morning before "
          "the sun rose. In the spring of that year, a stranger arrived with a cart full of books, and the village "
          "gathered to hear him read. He spoke of distant cities, of ships that crossed the ocean in a week, and of "
          "machines that could think.")


def test_bf16_serving_stays_close_to_fp32_and_leaves_the_trainer_model_alone(embedded_model_dir: Path) -> None:
    """bf16 keeps 8 significant bits (a relative rounding of at most 2**-9 per weight and product), so
    serving in it perturbs each logprob by a few hundredths to tenths of a nat after 30 layers, on any
    CPU: measured on a 2-core AVX2 EPYC, KL(fp32 || bf16) 6e-4 mean and 2.3e-3 at most over these 75
    positions, and the largest error on a top-10 token's logprob 0.2. What must hold is what follows
    from such a perturbation, with room for a CPU whose bf16 matmul rounds otherwise (oneDNN's packed
    path on AVX-512, or AMX): a small KL everywhere, and the same greedy token wherever fp32's best
    token leads the second by more than 1 nat (five times the largest error seen). Only near-ties may
    flip, and which positions are near-ties is fp32's to say, not the bf16 run's."""
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir).eval()
    exact, fast = LeanLlama(model, max_len=128), LeanLlama(model, max_len=128, dtype=torch.bfloat16)
    assert fast.linears[0]["gate_up"].weight.dtype == fast.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    ids = torch.tensor([tokenizer(_PROSE)["input_ids"]])
    length = ids.shape[1]
    logprobs = []
    for lean in (exact, fast):
        cache = lean.new_cache()
        cache.reserve(1, length + 4)
        hidden = lean.forward(ids, torch.arange(length)[None], torch.arange(1), cache, torch.tensor([length]))
        logprobs.append(torch.log_softmax(lean.logits(hidden).float(), dim=-1)[0])
    fp32, bf16 = logprobs
    kl = (fp32.exp() * (fp32 - bf16)).sum(-1)
    assert float(kl.mean()) < 5e-3 and float(kl.max()) < 2e-2, kl
    best_two = fp32.topk(2, dim=-1).values
    clear = best_two[:, 0] - best_two[:, 1] > 1.0
    assert int(clear.sum()) >= 20  # the text has enough clear positions for the check to mean something
    assert torch.equal(fp32.argmax(-1)[clear], bf16.argmax(-1)[clear])


async def test_greedy_output_is_the_same_with_and_without_a_reused_prefix(embedded_engine: TorchEngine) -> None:
    prompt = _prompt(embedded_engine, "Name three colors.")
    request = GenerationRequest(prompt, SamplingParams(max_tokens=12, temperature=0))
    first = (await _run(embedded_engine, request))[0]
    second = (await _run(embedded_engine, request))[0]  # prefix store hit: only the last token is prefilled
    assert second["ids"] == first["ids"]
    assert second["logprobs"] == pytest.approx(first["logprobs"], abs=1e-4)
    assert len(first["logprobs"]) == len(first["ids"])
    assert embedded_engine.tokenizer.decode(first["ids"], skip_special_tokens=True) == first["text"]


async def test_the_prefix_store_is_dropped_once_no_request_has_come_for_a_while(
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = TorchEngine(tiny_model_dir, prefix_cache_idle_seconds=0.5)
    try:
        request = GenerationRequest(_prompt(engine, "Name three colors."), SamplingParams(max_tokens=4, temperature=0))
        await _run(engine, request)
        assert await engine._on_worker(lambda: len(engine.scheduler.prefixes)) == 1  # the finished turn, kept
        with caplog.at_level(logging.INFO, logger="art_backend.engine.prefix_cache"):
            await asyncio.sleep(1.5)
        assert await engine._on_worker(lambda: (len(engine.scheduler.prefixes), engine.scheduler.prefixes.tokens)) == (0, 0)
        assert "Dropped the 1 kept prefixes" in caplog.text
        await _run(engine, request)  # and serving goes on, keeping turns again
        assert await engine._on_worker(lambda: len(engine.scheduler.prefixes)) == 1
    finally:
        await engine.close()


async def test_concurrent_requests_share_decode_steps(embedded_engine: TorchEngine) -> None:
    embedded_engine.peak_batch_size = 0
    requests = [GenerationRequest(_prompt(embedded_engine, f"Say something about {i}."),
                                  SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True))
                for i in range(16)]
    results = await asyncio.gather(*(_run(embedded_engine, r) for r in requests))
    assert all(len(r[0]["ids"]) == 16 for r in results)
    assert embedded_engine.peak_batch_size >= 8  # they were decoded together, not one after another
    cache = embedded_engine._cache
    # 16 rows grew the KV cache past its first 8 slots; with nothing active it is given back
    assert await embedded_engine._on_worker(lambda: (cache.slots, cache.capacity)) == cache.initial


def test_the_kv_cache_grows_by_a_step_of_tokens_keeping_what_it_held() -> None:
    cache = KVCache(layers=2, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), slots=2)
    for layer in cache.k:
        layer[1, :, 5] = 7.0
    cache.reserve(slots=3, capacity=KV_GROWTH_TOKENS + 30)  # e.g. a 30-token prompt and 256 new tokens
    assert (cache.slots, cache.capacity) == (4, 2 * KV_GROWTH_TOKENS)  # slots double; tokens round up to the step
    cache.reserve(slots=3, capacity=2 * KV_GROWTH_TOKENS + 1)
    assert cache.capacity == 3 * KV_GROWTH_TOKENS  # doubling would have made it 1,024
    keys = torch.stack(cache.k)
    assert bool((keys[:, 1, :, 5] == 7.0).all()) and float(keys.abs().sum()) == 7.0 * 2 * 4  # layers x head_dim
    cache.reserve(slots=1, capacity=10)  # never shrinks while in use
    assert (cache.slots, cache.capacity) == (4, 3 * KV_GROWTH_TOKENS)


async def _prefill_shapes_and_results(engine: TorchEngine, requests: list[GenerationRequest],
                                      ) -> tuple[list[tuple[int, int]], list[dict[int, dict]]]:
    """Run `requests` concurrently, recording the [rows, tokens] of every multi-token forward."""
    prefills: list[tuple[int, int]] = []
    forward = engine.lean.forward

    def recording(tokens: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if tokens.shape[1] > 1:
            prefills.append((tokens.shape[0], tokens.shape[1]))
        return forward(tokens, *args, **kwargs)

    engine.lean.forward = recording  # type: ignore[method-assign]
    try:
        return prefills, await asyncio.gather(*(_run(engine, r) for r in requests))
    finally:
        del engine.lean.forward


async def test_requests_prefilled_together_decode_as_each_alone(embedded_model_dir: Path) -> None:
    engine = TorchEngine(embedded_model_dir, prefix_cache_bytes=0)  # no KV kept between requests
    try:
        texts = ["Hi.", "What is the tallest mountain on Earth, and how tall is it?", "Name a color.",
                 "Count from one to five, please."]
        requests = [GenerationRequest(_prompt(engine, t), SamplingParams(max_tokens=8, temperature=0))
                    for t in texts]
        alone = [(await _run(engine, r))[0] for r in requests]
        prefills, together = await _prefill_shapes_and_results(engine, requests)

        # a long new prompt is not padded into a batch of short ones beyond half padding
        long_text = "Summarize this. " + "The river runs past the old mill and the bridge. " * 12
        mixed = [GenerationRequest(_prompt(engine, t), SamplingParams(max_tokens=2, temperature=0))
                 for t in ["Hi there.", long_text, "Name a fruit.", "Name a tree.", "Name a bird."]]
        mixed_prefills, _ = await _prefill_shapes_and_results(engine, mixed)
    finally:
        await engine.close()
    first = requests[0].prompt_ids
    new = [len(r.prompt_ids) - len(os.path.commonprefix([first, r.prompt_ids])) for r in requests]
    # the first alone; the other three reuse its KV of the shared system prompt and are padded
    # to the longest of their remaining prompts in one forward
    assert prefills == [(1, len(first)), (3, max(new[1:]))]
    first = mixed[0].prompt_ids
    new = [len(r.prompt_ids) - len(os.path.commonprefix([first, r.prompt_ids])) for r in mixed]
    assert new[1] > 4 * max(new[2:])
    # the long one and one short one (half padding at most), then the other two short ones
    # (which may reuse more than the system prompt: "Name a " of the one before them)
    assert [rows for rows, _ in mixed_prefills] == [1, 2, 2]
    assert mixed_prefills[1][1] == new[1] and mixed_prefills[2][1] <= max(new[3:])
    for one, batched in zip(alone, together):
        assert batched[0]["ids"] == one["ids"]
        assert batched[0]["logprobs"] == pytest.approx(one["logprobs"], abs=1e-3)


async def test_rows_reading_a_shared_prompt_start_decode_as_with_their_own_copies(embedded_model_dir: Path) -> None:
    # a group's rollouts read the keys and values of their common prompt start from one slot; the
    # numbers there are the same, so every token and logprob must be too, to the bit, also after
    # the sequence they read from has finished (the first stops after 3 tokens)
    engine = TorchEngine(embedded_model_dir, prefix_cache_bytes=0)
    if engine.lean.kernels is None:
        assert not shutil.which("c++"), "where a compiler exists, the kernels must build"
        await engine.close()
        pytest.skip("decode steps read a shared prompt start only with the fused CPU kernels")
    try:
        story = "Here is a story about a lighthouse keeper who counts the ships that pass each night. " * 4
        requests = [GenerationRequest(_prompt(engine, story + ending),
                                      SamplingParams(max_tokens=3 if i == 0 else 12, temperature=1.0, seed=i,
                                                     ignore_eos=True))
                    for i, ending in enumerate(["Go on.", "Go on, please.", "Continue it.", "Go on."])]
        shared: list[list[int]] = []
        find_shared = engine._shared_kv

        def recording() -> tuple[torch.Tensor, torch.Tensor] | None:
            found = find_shared()
            assert found is not None
            shared.append(found[1].tolist())
            return found

        engine._shared_kv = recording  # type: ignore[method-assign]
        reading_shared = await asyncio.gather(*(_run(engine, r) for r in requests))
        engine._shared_kv = lambda: None  # type: ignore[method-assign]
        own_copies = await asyncio.gather(*(_run(engine, r) for r in requests))
    finally:
        await engine.close()
    assert sum(n >= 64 for n in shared[0]) >= 3  # all but one row read the story from another's slot
    assert len(shared[-1]) == 3 and min(shared[-1]) >= 64  # the first finished; the rest read from each other
    for one, other in zip(reading_shared, own_copies):
        assert one[0]["ids"] == other[0]["ids"]
        assert one[0]["logprobs"] == other[0]["logprobs"]


async def test_lora_adapter_is_served_and_matches_peft(tiny_engine: TorchEngine, tmp_path: Path) -> None:
    peft_model = random_adapter(tiny_engine.model.name_or_path, tmp_path / "adapter", list(LORA_TARGETS))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4

    await tiny_engine.load_adapter("tiny@1", tmp_path / "adapter")
    served = tiny_engine.served_models()  # the session's engine: other tests' adapters may be served too
    assert served[0] == tiny_engine.base_model_name and "tiny@1" in served

    prompt = _prompt(tiny_engine, "Hello")
    with torch.no_grad():
        expected = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    adapted = (await _run(tiny_engine, GenerationRequest(prompt, SamplingParams(max_tokens=1, temperature=0),
                                                         model="tiny@1")))[0]
    plain = (await _run(tiny_engine, GenerationRequest(prompt, SamplingParams(max_tokens=1, temperature=0))))[0]
    assert adapted["ids"][0] == int(expected.argmax())
    assert adapted["logprobs"][0] == pytest.approx(float(expected.max()), abs=1e-4)
    assert adapted["logprobs"] != plain["logprobs"]

    with pytest.raises(ModelNotServedError, match="tiny@2"):
        await _run(tiny_engine, GenerationRequest(prompt, SamplingParams(max_tokens=1), model="tiny@2"))


async def test_adapter_and_base_rows_decode_together_as_each_alone(tiny_engine: TorchEngine, tmp_path: Path) -> None:
    # some modules of a fused projection only: the others are zero blocks of the stacked B
    peft_model = random_adapter(tiny_engine.model.name_or_path, tmp_path / "partial",
                                ["k_proj", "up_proj", "down_proj"])
    await tiny_engine.load_adapter("tiny-partial", tmp_path / "partial")
    try:
        prompt = _prompt(tiny_engine, "Tell me about rivers.")
        with torch.no_grad():
            expected = torch.log_softmax(peft_model(torch.tensor([prompt])).logits[0, -1], dim=-1)
        requests = [GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), model=m)
                    for m in ("tiny-partial", None, "tiny-partial")]
        alone = [(await _run(tiny_engine, r))[0] for r in requests[:2]]
        together = [r[0] for r in await asyncio.gather(*(_run(tiny_engine, r) for r in requests))]
    finally:
        await tiny_engine.remove_adapter("tiny-partial")
    assert alone[0]["ids"][0] == int(expected.argmax())
    assert alone[0]["logprobs"][0] == pytest.approx(float(expected.max()), abs=1e-4)
    assert alone[0]["ids"] != alone[1]["ids"]  # the adapter changes the output
    for got, want in zip(together, [alone[0], alone[1], alone[0]]):
        assert got["ids"] == want["ids"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


async def test_the_adapter_loaded_last_decodes_merged_as_unmerged(tiny_engine: TorchEngine, tmp_path: Path) -> None:
    first = random_adapter(tiny_engine.model.name_or_path, tmp_path / "first", list(LORA_TARGETS), seed=1)
    random_adapter(tiny_engine.model.name_or_path, tmp_path / "second", ["q_proj", "v_proj"], seed=2)
    prompt = _prompt(tiny_engine, "Count to ten.")
    with torch.no_grad():
        expected = torch.log_softmax(first(torch.tensor([prompt])).logits[0, -1], dim=-1)

    def request(model: str) -> GenerationRequest:
        return GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), model=model)

    try:
        # a checkpoint under two names, as training serves it: one adapter, merged
        await tiny_engine.load_adapter("tiny-first@1", tmp_path / "first")
        await tiny_engine.load_adapter("tiny-first", tmp_path / "first")
        adapter = tiny_engine.resolve_adapter("tiny-first")
        assert adapter is tiny_engine.resolve_adapter("tiny-first@1") and adapter is not None
        assert adapter.merged is not None
        merged = (await _run(tiny_engine, request("tiny-first")))[0]

        await tiny_engine.load_adapter("tiny-second", tmp_path / "second")
        second = tiny_engine.resolve_adapter("tiny-second")
        assert second is not None and second.merged is not None
        assert adapter.merged is None  # one merged copy at a time
        unmerged = (await _run(tiny_engine, request("tiny-first@1")))[0]

        await tiny_engine.load_adapter("tiny-first-again", tmp_path / "first")  # loaded last again: merged again
        assert tiny_engine.resolve_adapter("tiny-first-again") is adapter
        assert adapter.merged is not None and second.merged is None
    finally:
        for name in ("tiny-first@1", "tiny-first", "tiny-second", "tiny-first-again"):
            await tiny_engine.remove_adapter(name)
    assert merged["ids"][0] == int(expected.argmax())
    assert merged["logprobs"][0] == pytest.approx(float(expected.max()), abs=1e-4)
    assert merged["ids"] == unmerged["ids"]
    assert merged["logprobs"] == pytest.approx(unmerged["logprobs"], abs=1e-4)
