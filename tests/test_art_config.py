"""ART's config objects (`_internal_config`, `lora_config=`, `_config=`, backend.train's keywords) and
ART's names we lack: each field applied, mapped to the backend setting of the same meaning (with a
warning when the running backend cannot change it), or refused by name with the way forward."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import art_integrations as art
from art_integrations.art_compat.config import ArtConfigError, from_internal_config, train_config_with
from tests.conftest import scored_group

TINY = "tiny-random-smollm2"

# ART's 2048 example sets this on its model, to run on a T4
GAME_CONFIG = art.dev.InternalModelConfig(
    init_args=art.dev.InitArgs(max_seq_length=8192),
    engine_args=art.dev.EngineArgs(enforce_eager=True, gpu_memory_utilization=0.8, num_scheduler_steps=1),
)


def test_internal_config_fields_become_backend_and_lora_settings() -> None:
    mapped = from_internal_config({**GAME_CONFIG, "peft_args": art.dev.PeftArgs(r=4, lora_alpha=8, lora_dropout=0)})
    assert mapped.settings == {"max_model_len": 8192, "gpu_memory_utilization": 0.8,
                               "vllm_engine_args": {"enforce_eager": True, "num_scheduler_steps": 1}}
    assert mapped.lora == {"rank": 4, "alpha": 8}


def test_what_means_nothing_here_is_refused_by_name_all_at_once() -> None:
    with pytest.raises(ArtConfigError) as refused:
        from_internal_config({"init_args": {"load_in_4bit": True, "max_seq_length": 4096},
                              "engine_args": {"max_model_len": 8192, "model": "Qwen/Qwen2.5-7B-Instruct"},
                              "trainer_args": {"learning_rate": 1e-5}, "trainer_gpu_ids": [0]})
    message = str(refused.value)
    for named, way in [("init_args.load_in_4bit=True", "always False"), ("max_model_len", "already 4096"),
                       ("engine_args.model=", "base_model"), ("trainer_args", "TrainConfig"),
                       ("trainer_gpu_ids=[0]", "--tensor-parallel-size")]:
        assert named in message and way in message, (named, message)


def test_underscore_config_applies_what_means_the_same_and_notes_what_changes_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = train_config_with(art.TrainConfig(learning_rate=3e-5), {
            "logprob_calculation_chunk_size": 8, "ppo": True, "epsilon": 0.3, "scale_rewards": False,
            "advantage_balance": 0.0, "importance_sampling_level": "token"})
    assert (config.learning_rate, config.loss, config.epsilon, config.scale_rewards) == (3e-5, "ppo", 0.3, False)
    assert "logprob_calculation_chunk_size=8 is taken but changes nothing" in caplog.text
    with caplog.at_level(logging.WARNING):
        config = train_config_with(art.TrainConfig(), {"importance_sampling_level": "sequence",
                                                       "truncated_importance_sampling": 2.0})
    assert config.importance_sampling_level == "sequence"
    assert "truncated_importance_sampling=2.0 is taken but changes nothing" in caplog.text
    assert "the sampler's own, never recomputed" in caplog.text
    with pytest.raises(ValueError, match="'average' is offered with loss='cispo' only"):
        train_config_with(art.TrainConfig(), {"importance_sampling_level": "average", "ppo": True})
    with pytest.raises(ArtConfigError, match="mask_prob_ratio=True .*always False"):
        train_config_with(art.TrainConfig(), {"mask_prob_ratio": True})
    with pytest.raises(ArtConfigError, match="epsilon=0.3.*TrainConfig says 0.2"):
        train_config_with(art.TrainConfig(epsilon=0.2), {"epsilon": 0.3})
    with pytest.raises(ArtConfigError, match="learnin_rate=.*TrainConfig's fields are"):
        train_config_with(art.TrainConfig(), {"learnin_rate": 1e-5})


def test_art_names_on_models_and_backends_say_what_to_use() -> None:
    model = art.TrainableModel(name="m", project="p", run_name="m", lora_config=art.LoRAConfig(rank=4, alpha=8))
    assert (model.lora.rank, model.lora.alpha) == (4, 8)
    with pytest.raises(ValueError, match="lora_config.*pass one"):
        art.TrainableModel(name="m", project="p", lora=art.LoraConfig(), lora_config={"rank": 4})
    with pytest.raises(ArtConfigError, match="dropout=0.1 .*here it is always 0"):
        art.TrainableModel(name="m", project="p", lora_config={"rank": 4, "dropout": 0.1})
    with pytest.raises(AttributeError, match="'litellm_completion_params' .*api_base=model.inference_base_url"):
        model.litellm_completion_params()
    with pytest.raises(AttributeError, match="'_experimental_fork_checkpoint' .*pull_checkpoints"):
        art.RemoteBackend("http://127.0.0.1:9")._experimental_fork_checkpoint  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        model.trian  # noqa: B018


async def test_a_registered_model_takes_its_internal_config_and_trains_with_underscore_config(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with art.LocalBackend(in_process=True, model=TINY, art_dir=tmp_path) as backend:
        model = art.TrainableModel(name="game", project="ports")
        model._internal_config = {**GAME_CONFIG, "peft_args": {"r": 4, "lora_alpha": 8}}  # as ART's examples do
        with caplog.at_level(logging.WARNING):
            await model.register(backend)
        assert "ART_BACKEND_MAX_MODEL_LEN=8192" in caplog.text and "ART_BACKEND_GPU_MEMORY_UTILIZATION=0.8" in caplog.text
        assert 'ART_BACKEND_VLLM_ENGINE_ARGS={"enforce_eager": true, "num_scheduler_steps": 1}' in caplog.text
        described = json.loads((tmp_path / "ports" / "models" / "game" / "model.json").read_text())
        assert (described["lora"]["rank"], described["lora"]["alpha"]) == (4, 8)

        group = await scored_group(model, "a", [0.0, 1.0, 0.5])
        result = await model.train([group], config=art.TrainConfig(learning_rate=1e-3),
                                   _config={"logprob_calculation_chunk_size": 8})
        assert result.step == 1 and result.metrics["trained"]
        result = await backend.train(model, [await scored_group(model, "b", [1.0, 0.0])], learning_rate=1e-3,
                                     loss_fn="ppo", optimizer_save_interval=5, kl_penalty_source="sample")
        assert result.step == 2
        with pytest.raises(ArtConfigError, match="kl_penalty_coef=0.1 .*beta"):
            await backend.train(model, [group], kl_penalty_coef=0.1)
        with pytest.raises(ArtConfigError,
                           match=r"kl_penalty_reference_step=1 .*TrainConfig\(beta=\.\.\., kl_reference_step=N"):
            await model.train([group], _config={"kl_penalty_reference_step": 1})

        other = art.TrainableModel(name="other", project="ports", _internal_config={"engine_args": {"enable_lora": False}})
        with pytest.raises(ArtConfigError, match="enable_lora=False .*always True"):
            await other.register(backend)


async def test_a_backend_given_no_model_starts_with_the_first_models_internal_config(
        tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ART's pattern: `LocalBackend()`, then a model whose `_internal_config` sizes the engine; here the
    backend starts on that model's base with those settings (not only a warning)."""
    monkeypatch.delenv("ART_BACKEND_MODEL", raising=False)
    async with art.LocalBackend(in_process=True, art_dir=tmp_path) as backend:
        model = art.TrainableModel(name="sized", project="ports", base_model=str(tiny_model_dir),
                                   _internal_config={"init_args": {"max_seq_length": 512}})
        await model.register(backend)
        client = model.openai_client()
        with pytest.raises(Exception, match="maximum context length is 512 tokens"):
            await client.chat.completions.create(model=model.name, max_tokens=600,
                                                 messages=[{"role": "user", "content": "hi"}])
