"""The contract every engine keeps, checked on each (torch and vLLM) with the embedded model:
logprobs are the trainer's, adapters are served as peft computes them, seeds reproduce, stop
strings cut, grammars hold, adapters a backend cannot serve are refused by name; and how the
backend picks and configures an engine."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from art_backend.app import build_engine, choose_engine
from art_backend.chat_format import ChatFormatter, encode_prompt
from art_backend.config import BackendSettings, default_cache_dir
from art_backend.engine.base import Engine, GenerationRequest, SamplingParams
from art_backend.engine.sampling import Penalties, RowSampling, gumbel_argmax, truncate
from art_backend.errors import ModelNotServedError
from art_backend.grammar import json_grammar
from art_integrations import LocalBackend
from art_integrations.training import LoraConfig
from tests.conftest import ENGINES, embedded_engine_named, random_adapter

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Engine:
    return embedded_engine_named(request, request.param)


@pytest.fixture(scope="module")
def reference_model(embedded_model_dir: Path) -> Any:
    """transformers' model in float32: what the trainer recomputes logprobs with."""
    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()


def _prompt(engine: Engine, text: str) -> list[int]:
    return encode_prompt(engine.tokenizer, ChatFormatter(engine.tokenizer).render(
        [{"role": "user", "content": text}], None, None))


async def _run(engine: Engine, request: GenerationRequest) -> dict[int, dict]:
    out: dict[int, dict] = {}
    async for delta in engine.generate(request):
        seq = out.setdefault(delta.index, {"ids": [], "logprobs": [], "top": [], "text": "", "finish": None})
        seq["ids"] += delta.token_ids
        seq["logprobs"] += [lp.logprob for lp in delta.logprobs]
        seq["top"] += [lp.top for lp in delta.logprobs]
        seq["text"] += delta.text
        seq["finish"] = delta.finish_reason or seq["finish"]
    return out


def _trainer_logprobs(model: Any, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    """log softmax(logits / temperature) at each completion token, as `LoraTrainer` computes it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature", [0.0, 0.7])
async def test_sampled_logprobs_are_the_ones_the_trainer_recomputes(engine: Engine, reference_model: Any,
                                                                    temperature: float) -> None:
    prompt = _prompt(engine, "Name three colors.")
    out = (await _run(engine, GenerationRequest(prompt, SamplingParams(
        max_tokens=24, temperature=temperature, seed=1, top_logprobs=3))))[0]
    assert engine.tokenizer.decode(out["ids"], skip_special_tokens=True) == out["text"]
    expected = _trainer_logprobs(reference_model, prompt, out["ids"], temperature or 1.0)
    assert out["logprobs"] == pytest.approx(expected, abs=2e-3)
    for top, chosen in zip(out["top"], out["logprobs"]):
        assert len(top) == 3 and [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0][1] >= chosen - 1e-5


async def test_an_adapter_is_served_as_peft_computes_it(engine: Engine, embedded_model_dir: Path,
                                                        tmp_path: Path) -> None:
    peft_model = random_adapter(embedded_model_dir, tmp_path / "adapter", ALL_PROJECTIONS, rank=8, scale=0.02)
    # one checkpoint under two names, as the training service serves it (older steps read on first use)
    await engine.load_adapter("probe@1", tmp_path / "adapter", preload=False)
    await engine.load_adapter("probe", tmp_path / "adapter")
    try:
        assert {"probe", "probe@1"} <= set(engine.served_models())
        prompt = _prompt(engine, "Name three colors.")
        greedy = SamplingParams(max_tokens=16, temperature=0)
        adapted = (await _run(engine, GenerationRequest(prompt, greedy, model="probe")))[0]
        again = (await _run(engine, GenerationRequest(prompt, greedy, model="probe@1")))[0]
        plain = (await _run(engine, GenerationRequest(prompt, greedy)))[0]
        assert adapted["ids"] == again["ids"]
        assert adapted["logprobs"] != pytest.approx(plain["logprobs"][:len(adapted["logprobs"])], abs=1e-3)
        expected = _trainer_logprobs(peft_model, prompt, adapted["ids"], 1.0)
        assert adapted["logprobs"] == pytest.approx(expected, abs=2e-3)
    finally:
        for name in ("probe", "probe@1"):
            await engine.remove_adapter(name)
    assert "probe" not in engine.served_models()
    with pytest.raises(ModelNotServedError, match="probe"):
        await _run(engine, GenerationRequest(_prompt(engine, "x"), SamplingParams(max_tokens=1), model="probe"))


async def test_each_request_of_a_batch_gets_its_own_adapter_or_none(engine: Engine, embedded_model_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Four adapters (the vLLM engine's slots, all in use) and the base model in one batch: each
    request is served as if alone (vLLM's own CPU ops served the base request with the last slot's
    adapter: vllm_cpu_lora.py)."""
    names = [f"slot{i}" for i in range(4)]
    for seed, name in enumerate(names):
        random_adapter(embedded_model_dir, tmp_path / name, ALL_PROJECTIONS, seed=seed, rank=8, scale=0.05)
    for name in names:
        await engine.load_adapter(name, tmp_path / name)
    try:
        prompt = _prompt(engine, "Name three colors.")
        greedy = SamplingParams(max_tokens=8, temperature=0)
        models = [None, *names]
        alone = [(await _run(engine, GenerationRequest(prompt, greedy, model=m)))[0] for m in models]
        batched = [out[0] for out in await asyncio.gather(
            *(_run(engine, GenerationRequest(prompt, greedy, model=m)) for m in models))]
    finally:
        for name in names:
            await engine.remove_adapter(name)
    assert len({tuple(out["logprobs"][:3]) for out in alone}) == len(models)  # each adapter changes the model
    for model, by_itself, beside_others in zip(models, alone, batched):
        assert beside_others["ids"] == by_itself["ids"], model
        assert beside_others["logprobs"] == pytest.approx(by_itself["logprobs"], abs=2e-3), model


@pytest.mark.vllm
@pytest.mark.parametrize("indices", [[0] * 6, [0, 1, 1, -1, 0, 1], [-1] * 6, [1]],
                         ids=["one", "mixed", "none", "single"])
@pytest.mark.parametrize("add_inputs", [True, False])
def test_the_grouped_cpu_lora_ops_take_vllms_products(indices: list[int], add_inputs: bool) -> None:
    """Where vLLM's own CPU ops are right (the slot -1 reads, the last, holds no adapter), ours give
    their numbers, for every op, with one adapter, several, none, and a single token."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv")
    from vllm.lora.ops.torch_ops import lora_ops

    from art_backend.engine import vllm_cpu_lora

    torch.manual_seed(0)
    a, b = torch.randn(3, 1, 8, 64), torch.randn(3, 1, 96, 8)
    a[-1], b[-1] = 0, 0
    index = torch.tensor(indices)
    x, shrunk = torch.randn(len(indices), 64), torch.randn(len(indices), 8)
    for ours, theirs, args in (
            (vllm_cpu_lora.bgmv_shrink, lora_ops.bgmv_shrink, (x, a, index, 0.5)),
            (vllm_cpu_lora.bgmv_expand, lora_ops.bgmv_expand, (shrunk, b, index, add_inputs)),
            (vllm_cpu_lora.bgmv_expand_slice, lora_ops.bgmv_expand_slice, (shrunk, b, index, 16, 96, add_inputs))):
        width = 8 if ours is vllm_cpu_lora.bgmv_shrink else 128
        start = torch.randn(len(indices), width)
        expected, got = start.clone(), start.clone()
        theirs(args[0], args[1], expected, *args[2:])
        ours(args[0], args[1], got, *args[2:])
        assert torch.allclose(got, expected, atol=1e-5), ours.__name__


async def test_a_seed_reproduces_sampling_and_n_samples_differ(engine: Engine) -> None:
    prompt = _prompt(engine, "Tell me a word.")
    request = GenerationRequest(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=7), n=3)
    a, b = await _run(engine, request), await _run(engine, request)
    assert [a[i]["ids"] for i in range(3)] == [b[i]["ids"] for i in range(3)]
    assert len({tuple(a[i]["ids"]) for i in range(3)}) > 1


def _vllm_on_cpu() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's GPU sampler draws other noise (its generator's exponentials): seeds match on CPU only")
    current_platform.import_kernels()


@pytest.mark.vllm
def test_the_gumbel_draw_is_vllms_cpu_samplers() -> None:
    _vllm_on_cpu()
    torch.manual_seed(0)
    for vocab in (7, 49152):
        scaled = torch.randn(128, vocab) * 3
        scaled[::4, 3:] = float("-inf")
        seeds = torch.randint(0, 2**31, (128,))
        assert torch.equal(torch.ops._C.fused_gumbel_argmax(scaled, seeds), gumbel_argmax(scaled, seeds))


@pytest.mark.vllm
async def test_a_seeded_request_samples_the_same_tokens_on_both_engines(embedded_engine: Engine,
                                                                       embedded_vllm_engine: Engine) -> None:
    """Both engines draw vLLM's CPU Gumbel-max noise from the request's seed (sampling.py), so a
    seeded run repeats on the other engine token for token (up to near-ties in the logits)."""
    _vllm_on_cpu()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    grammar = json_grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    requests = [
        GenerationRequest(_prompt(embedded_engine, "Tell me a story about a cat."),
                          SamplingParams(max_tokens=24, temperature=0.8, seed=11), n=3),
        GenerationRequest(_prompt(embedded_engine, "Name a city."),
                          SamplingParams(max_tokens=16, temperature=1.0, seed=5, grammar=grammar)),
    ]
    for request in requests:
        torch_ids = [s["ids"] for _, s in sorted((await _run(embedded_engine, request)).items())]
        vllm_ids = [s["ids"] for _, s in sorted((await _run(embedded_vllm_engine, request)).items())]
        assert torch_ids == vllm_ids
        assert len({tuple(ids) for ids in torch_ids}) == len(torch_ids)  # n samples differ


async def test_a_stop_string_cuts_the_text(engine: Engine) -> None:
    prompt = _prompt(engine, "Count from 1 to 10, separated by commas.")
    plain = (await _run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=20, temperature=0))))[0]
    assert "," in plain["text"], plain["text"]
    stopped = (await _run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=20, temperature=0,
                                                                            stop=(",",)))))[0]
    assert stopped["finish"] == "stop"
    assert stopped["text"] == plain["text"].split(",")[0]
    assert engine.tokenizer.decode(stopped["ids"], skip_special_tokens=True).startswith(stopped["text"] + ",")


async def test_a_grammar_holds_and_the_logprobs_are_the_policys_own(engine: Engine, reference_model: Any) -> None:
    """Under a grammar both engines report the policy's logprob before the mask, at the request's
    temperature (vLLM itself would report 0.0 for a forced token: vllm_policy_logprobs.py)."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    grammar = json_grammar({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    prompt, free_prompt = _prompt(engine, "What is 2 + 2?"), _prompt(engine, "Name three colors.")
    outs, free = await asyncio.gather(  # one batch: rows with and without a grammar side by side
        _run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=0, grammar=grammar),
                                       n=4)),
        _run(engine, GenerationRequest(free_prompt, SamplingParams(max_tokens=24, temperature=0.7, seed=1))))
    assert free[0]["logprobs"] == pytest.approx(
        _trainer_logprobs(reference_model, free_prompt, free[0]["ids"], 0.7), abs=2e-3)
    for out in outs.values():
        assert out["finish"] == "stop"
        assert isinstance(json.loads(out["text"])["answer"], int)
        models_own = _trainer_logprobs(reference_model, prompt, out["ids"], 0.7)
        assert models_own[0] < -5  # the grammar forces "{" although the model would rather talk
        assert out["logprobs"] == pytest.approx(models_own, abs=2e-3)


def test_an_adapter_the_engine_cannot_serve_is_refused_by_name(engine: Engine) -> None:
    with pytest.raises(ValueError, match="embed_tokens"):
        engine.check_lora(LoraConfig(target_modules=["q_proj", "embed_tokens"]))
    engine.check_lora(LoraConfig())
    if type(engine).__name__ == "VLLMEngine":
        with pytest.raises(ValueError, match="--max-lora-rank 32"):
            engine.check_lora(LoraConfig(rank=24))


def test_auto_picks_the_torch_engine_without_a_gpu() -> None:
    assert choose_engine("auto") == ("torch", "auto: no CUDA GPU")
    assert choose_engine("vllm") == ("vllm", "asked for")


def test_auto_picks_vllm_where_a_gpu_and_vllm_are_both_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "vllm" else find_spec(name))
    assert choose_engine("auto") == (
        "torch", "auto: CUDA GPU but vLLM is not installed (pip install 'art-backend[vllm]')")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: find_spec("json" if name == "vllm" else name))
    assert choose_engine("auto") == ("vllm", "auto: CUDA GPU and vLLM")
    assert choose_engine("torch") == ("torch", "asked for")


def test_unknown_engine_settings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'tensorrt'"):
        LocalBackend(engine="tensorrt")
    for args, expected in ((["--engine", "tensorrt"], "use auto, torch or vllm"),
                           (["--engine", "vllm", "--vllm-engine-args", "[1]"], "JSON object"),
                           (["--engine", "vllm", "--vllm-engine-args", "{enforce"], "not JSON")):
        result = subprocess.run([sys.executable, "-m", "art_backend", "serve", *args],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and expected in result.stderr, result.stderr


def test_a_misspelt_backend_setting_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"Not backend settings: max_lora\b.*max_loras"):
        BackendSettings(max_lora=8)
    result = subprocess.run([sys.executable, "-m", "art_backend", "serve", "--port", "1"], capture_output=True,
                            text=True, timeout=120, env={**os.environ, "ART_BACKEND_MAX_LORA": "8"})
    assert result.returncode != 0 and "ART_BACKEND_MAX_LORA" in result.stderr, result.stderr
    monkeypatch.setenv("ART_BACKEND_MAX_LORAS", "3")
    assert BackendSettings().max_loras == 3


def test_an_empty_backend_variable_means_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_BACKEND_CACHE_DIR", "")  # not the current directory
    monkeypatch.setenv("ART_BACKEND_MAX_LORAS", "")
    settings = BackendSettings()
    assert settings.cache_dir == default_cache_dir()
    assert settings.max_loras == BackendSettings.model_fields["max_loras"].default


@pytest.mark.vllm
def test_vllm_engine_arguments_are_checked_before_vllm_starts(tiny_model_dir: Path) -> None:
    pytest.importorskip("vllm")
    from art_backend.engine.vllm_engine import VLLMEngine

    with pytest.raises(ValueError, match="enforce_eagerly"):
        VLLMEngine(tiny_model_dir, engine_args={"enforce_eagerly": True})
    with pytest.raises(ValueError, match="max_lora_rank=24"):
        VLLMEngine(tiny_model_dir, max_lora_rank=24)


@pytest.mark.vllm
def test_vllm_starts_with_the_batch_limits_its_own_server_picks(tiny_model_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM picks max_num_seqs and max_num_batched_tokens by hardware and by who starts it; we
    serve the OpenAI API, so ours must be the server's. An H100 picked 1024 and 8192 for the server
    and left our engine on 128 and 2048; on a CPU both are 128 and 2048, so here the hardware's
    table is replaced by one where they differ. The config is vLLM's own, resolved as the engine
    starts it; the start stops there (the engine's processes would add ~40 s and tell nothing more)."""
    pytest.importorskip("vllm")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    from art_backend.engine.vllm_engine import VLLMEngine

    server = UsageContext.OPENAI_API_SERVER
    monkeypatch.setattr(AsyncEngineArgs, "get_batch_defaults",
                        classmethod(lambda cls, world_size: ({server: 4096}, {server: 96})))
    started: list[Any] = []

    class Resolved(Exception):
        pass

    def record_the_config(self: Any, vllm_config: Any, **_: Any) -> None:
        started.append(vllm_config)
        raise Resolved

    monkeypatch.setattr(AsyncLLM, "__init__", record_the_config)
    monkeypatch.setattr(AsyncLLM, "__del__", lambda self: None)  # nothing was started to shut down
    with pytest.raises(Resolved):
        VLLMEngine(tiny_model_dir)
    scheduler = started[0].scheduler_config
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (96, 4096)


def test_asking_for_vllm_without_it_says_how_to_install_it(tiny_model_dir: Path) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed in this venv")
    with pytest.raises(RuntimeError, match=r"art-backend\[vllm\]"):
        build_engine(BackendSettings(model=str(tiny_model_dir), engine="vllm"))


@pytest.mark.vllm
async def test_closing_a_generation_aborts_its_vllm_request(embedded_vllm_engine: Engine) -> None:
    engine: Any = embedded_vllm_engine
    stream = engine.generate(GenerationRequest(_prompt(engine, "Tell me a long story."), SamplingParams(
        max_tokens=2000, temperature=1.0, ignore_eos=True), n=2))
    first = await anext(stream)
    assert first.token_ids
    assert engine._llm.get_num_unfinished_requests() > 0
    await stream.aclose()
    for _ in range(200):
        if engine._llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.05)
    assert engine._llm.get_num_unfinished_requests() == 0


def test_a_setting_the_chosen_engine_does_not_read_is_warned_about(tiny_model_dir: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="art_backend.app"):
        engine = build_engine(BackendSettings(model=str(tiny_model_dir), engine="torch", max_loras=2))
    asyncio.run(engine.close())
    assert "Engine: torch (asked for)" in caplog.text
    assert "without effect: max_loras (ART_BACKEND_MAX_LORAS)" in caplog.text


def _drawn_logprobs(model: Any, prompt: list[int], completion: list[int], params: SamplingParams) -> list[float]:
    """From transformers' float32 logits, each completion token's logprob in the distribution it
    was drawn from (penalties and bias, temperature, min-p, top-k and top-p: `sampling.py`'s steps)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    row = RowSampling(params.temperature, params.top_p, 0, None, params.top_k, params.min_p)
    penalties = Penalties.for_prompt(prompt, params.frequency_penalty, params.presence_penalty,
                                     params.repetition_penalty, params.logit_bias)
    assert penalties is not None
    drawn = []
    for position, token in enumerate(completion):
        penalties.apply(logits[position])
        scaled = truncate(logits[position:position + 1] / params.temperature, [row])
        drawn.append(float(torch.log_softmax(scaled, dim=-1)[0, token]))
        penalties.record(token)
    return drawn


@pytest.mark.parametrize("cuts", [{"top_p": 0.9, "top_k": 20, "min_p": 0.02}, {}], ids=["cuts", "penalties-only"])
async def test_penalties_bias_and_cuts_shape_the_draw_and_the_logprobs_are_the_policys(
        engine: Engine, reference_model: Any, cuts: dict[str, Any]) -> None:
    prompt = _prompt(engine, "Count from 1 to 20, separated by commas.")
    comma = engine.tokenizer.convert_tokens_to_ids(",")
    params = SamplingParams(max_tokens=24, temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3,
                            repetition_penalty=1.2, logit_bias={comma: -3.0}, seed=5, **cuts)
    outs = await _run(engine, GenerationRequest(prompt, params, n=2))
    for out in outs.values():
        drawn = _drawn_logprobs(reference_model, prompt, out["ids"], params)
        policy = _trainer_logprobs(reference_model, prompt, out["ids"], params.temperature)
        assert all(lp > -1e9 for lp in drawn), "a token outside the cut was drawn"
        # what the trainer recomputes (log_softmax(logits / T)), so the importance ratio of the
        # policy that sampled is 1; the settings moved the drawn distribution well away from it
        assert out["logprobs"] == pytest.approx(policy, abs=2e-3)
        assert max(abs(d - p) for d, p in zip(drawn, policy)) > 0.1


async def test_a_large_logit_bias_forces_a_token_and_penalties_change_greedy_text(engine: Engine) -> None:
    prompt = _prompt(engine, "Count from 1 to 20, separated by commas.")
    paris = engine.tokenizer.encode("Paris", add_special_tokens=False)[0]
    biased = (await _run(engine, GenerationRequest(prompt, SamplingParams(
        max_tokens=3, temperature=0, logit_bias={paris: 100.0}))))[0]
    assert biased["ids"][0] == paris
    plain = (await _run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=24, temperature=0))))[0]
    penalized = (await _run(engine, GenerationRequest(prompt, SamplingParams(
        max_tokens=24, temperature=0, frequency_penalty=2.0))))[0]
    assert penalized["ids"] != plain["ids"]


async def test_a_grammar_that_cannot_be_followed_fails_its_request_alone(engine: Engine) -> None:
    node = {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}, "required": ["child"]}
    endless = json_grammar({"type": "json_schema", "json_schema": {"name": "n", "schema": {  # no finite instance
        "$defs": {"node": node}, "$ref": "#/$defs/node"}}})
    prompt = _prompt(engine, "Hi")
    failed, *others = await asyncio.gather(
        _run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=64, grammar=endless))),
        *(_run(engine, GenerationRequest(prompt, SamplingParams(max_tokens=12))) for _ in range(4)),
        return_exceptions=True)
    assert isinstance(failed, ValueError) and "cannot be enforced" in str(failed)
    assert all(isinstance(out, dict) and out[0]["finish"] in ("stop", "length") for out in others)
