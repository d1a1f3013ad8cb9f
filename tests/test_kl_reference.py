"""The KL term toward one of the model's own checkpoints (`TrainConfig(beta=..., kl_reference_step=N)`):
the reference logprobs come from that checkpoint's adapter, the trained adapter's gradients are
what they would be without the detour, and a step naming a checkpoint the model lacks is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from art_backend.errors import DamagedCheckpointError
from art_backend.training.trainer import LoraTrainer
from art_integrations import BackendError, RemoteBackend, TrainableModel, Trajectory, TrainSFTConfig
from art_integrations.training import LoraConfig, TrainConfig
from tests.conftest import scored_group
from tests.test_packing import captured_sequences

ANSWER = [{"role": "user", "content": "What is on the pizza?"},
          {"role": "assistant", "content": "pineapple and ham"}]


@pytest.fixture
def trainer(tiny_model_dir: Path) -> LoraTrainer:
    trainer = LoraTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    trainer._adapter("m", LoraConfig(), None)  # noqa: SLF001 - the adapter the steps train
    _move_adapter(trainer, seed=0)
    return trainer


def _move_adapter(trainer: LoraTrainer, seed: int) -> None:
    """New random B matrices (a fresh adapter's are zero: the policy would be the base model's)."""
    assert trainer.peft is not None
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.peft.named_parameters():
            if "lora_B" in name and ".m_m." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def _step(trainer: LoraTrainer, config: TrainConfig, reference: Path | None) -> tuple[float, dict[str, torch.Tensor]]:
    assert trainer.peft is not None
    sequences, _ = captured_sequences("city_facts_step.jsonl")
    trainer.peft.zero_grad(set_to_none=True)
    sums = trainer.accumulate_gradients(sequences, config, kl_reference=reference)
    return sums["kl"], {n: p.grad.clone() for n, p in trainer.peft.named_parameters() if p.grad is not None}


def test_the_kl_is_measured_against_the_named_checkpoint_not_the_base(trainer: LoraTrainer, tmp_path: Path) -> None:
    assert trainer.peft is not None
    key = trainer.keys["m"]
    trainer._save(key, trainer.optimizers[key], tmp_path / "0001")  # noqa: SLF001 - the policy as it is now
    config = TrainConfig(temperature=0.7, beta=0.1)

    kl_to_itself, gradients = _step(trainer, config, tmp_path / "0001")
    kl_to_base, _ = _step(trainer, config, None)
    _, without_kl = _step(trainer, config.model_copy(update={"beta": 0.0}), None)
    assert abs(kl_to_itself) < 1e-6 < 1e-3 < kl_to_base, (kl_to_itself, kl_to_base)
    # at the reference the KL's gradient is zero: the step's gradients are the policy loss's alone,
    # on the trained adapter only (the reference's is frozen and the trained one trainable again)
    assert gradients.keys() == without_kl.keys() and all(f".{key}." in name for name in gradients)
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, without_kl[name], rtol=1e-4, atol=1e-7, msg=name)
    assert trainer.peft.active_adapter == key

    _move_adapter(trainer, seed=1)  # the policy moves away from the checkpoint: the KL to it grows
    kl_after_moving, _ = _step(trainer, config, tmp_path / "0001")
    kl_to_base_after_moving, _ = _step(trainer, config, None)
    assert kl_after_moving > 1e-3 and abs(kl_after_moving - kl_to_base_after_moving) > 1e-4

    (tmp_path / "0002").mkdir()  # a checkpoint without its adapter file
    with pytest.raises(DamagedCheckpointError, match=r"Cannot read the KL reference .*0002"):
        _step(trainer, config, tmp_path / "0002")
    assert trainer.peft.active_adapter == key
    assert _step(trainer, config, tmp_path / "0001")[0] == pytest.approx(kl_after_moving, rel=1e-5)


async def test_grpo_after_sft_can_stay_near_the_sft_checkpoint(tiny_training_server) -> None:  # noqa: ANN001
    backend = RemoteBackend(tiny_training_server.base_url)
    model = TrainableModel(name="kl-to-sft", project="kl-reference")
    await model.register(backend)
    with pytest.raises(BackendError, match=r"kl_reference_step=1 names a checkpoint kl-to-sft does not have "
                                           r"\(it has no checkpoint yet\)"):
        await model.train([await scored_group(model, "q", [0.0, 1.0])],
                          config=TrainConfig(beta=0.1, kl_reference_step=1))
    await model.train_sft([Trajectory(messages_and_choices=ANSWER)] * 2,
                          TrainSFTConfig(learning_rate=2e-3, batch_size=1))

    group = await scored_group(model, "q", [0.0, 1.0, 0.5])  # sampled by the SFT checkpoint
    near_sft = await model.train([group], config=TrainConfig(beta=0.1, kl_reference_step=1))
    near_base = await model.train([group], config=TrainConfig(beta=0.1, kl_reference_step=0))  # 0: the base, as ART
    assert abs(near_sft.metrics["kl"]) < 1e-6 < 1e-4 < near_base.metrics["kl"], (near_sft.metrics, near_base.metrics)

    with pytest.raises(BackendError, match=r"kl_reference_step=9 names a checkpoint .*its newest is step 3\)"):
        await model.train([group], config=TrainConfig(beta=0.1, kl_reference_step=9))
    assert await model.get_step() == 3
    with pytest.raises(ValueError, match=r"kl_reference_step=1 .*the KL term is off \(beta=0\)"):
        TrainConfig(kl_reference_step=1)
    await backend.close()
