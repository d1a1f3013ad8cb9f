"""GRPO pieces in isolation: the loss against a hand computation, sequence building, advantages."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from art_backend.training.loss import LossConfig, importance_ratio, policy_loss, sequence_log_ratio
from art_backend.training.grpo import group_advantages
from art_backend.training.tokenize import MissingTokensError, TokenizeStats, tokenize_trajectory
from art_integrations import Choice, History, TrainConfig, Trajectory


def test_cispo_loss_matches_a_hand_computation() -> None:
    logp_new = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    logp_rollout = torch.tensor([-1.0, -1.0, -3.0])
    advantages = torch.tensor([1.0, -1.0, 2.0])
    weights = torch.tensor([0.5, 0.25, 0.25])
    terms = policy_loss(logp_new, logp_rollout, advantages, weights, LossConfig("cispo", 0.2, 0.5))
    # ratios: 1, e^-1 = 0.368 -> clipped to 0.8, e^2.5 = 12.18 -> clipped to 1.5
    expected = -(0.5 * 1.0 * 1.0 * -1.0 + 0.25 * 0.8 * -1.0 * -2.0 + 0.25 * 1.5 * 2.0 * -0.5)
    assert terms.loss.item() == pytest.approx(expected)
    assert float(terms.clipped_fraction) == pytest.approx(0.5)
    terms.loss.backward()
    # d loss / d logp_new_t = -w_t * clip(ratio_t) * A_t (the clipped ratio carries no gradient)
    assert logp_new.grad.tolist() == pytest.approx([-0.5, 0.2, -0.75])


def test_ppo_loss_matches_a_hand_computation() -> None:
    logp_new = torch.tensor([math.log(1.5), math.log(0.5)])
    logp_rollout = torch.zeros(2)
    advantages = torch.tensor([1.0, 1.0])
    weights = torch.tensor([0.5, 0.5])
    terms = policy_loss(logp_new, logp_rollout, advantages, weights, LossConfig("ppo", 0.2, 0.2))
    # token 0: min(1.5, 1.2) = 1.2; token 1: min(0.5, 0.8) = 0.5
    assert float(terms.loss) == pytest.approx(-(0.5 * 1.2 + 0.5 * 0.5))


def test_the_sequence_ratio_is_the_geometric_mean_of_its_tokens_ratios() -> None:
    # two sequences: tokens 0-2 (token 1 not trained) and 3-4
    log_ratio = torch.tensor([math.log(2.0), 5.0, math.log(0.5), math.log(3.0), math.log(1 / 3)])
    sequence_ids = torch.tensor([0, 0, 0, 1, 1])
    trained = torch.tensor([True, False, True, True, True])
    log_s = sequence_log_ratio(log_ratio, sequence_ids, trained)
    # (prod_t ratio_t)^(1/|T|) over the trained tokens: (2 * 0.5)^(1/2) = 1, (3 * 1/3)^(1/2) = 1
    assert log_s.exp().tolist() == pytest.approx([1.0] * 5)
    uneven = torch.tensor([math.log(2.0), 0.0, math.log(8.0), math.log(3.0), math.log(3.0)])
    s = sequence_log_ratio(uneven, sequence_ids, trained).exp()
    assert s.tolist() == pytest.approx([4.0, 4.0, 4.0, 3.0, 3.0])  # sqrt(2 * 8), sqrt(3 * 3)
    log_s = s.log()
    ratios = uneven.exp()
    assert importance_ratio(uneven, "token", None).tolist() == pytest.approx(ratios.tolist())
    assert importance_ratio(uneven, "sequence", log_s).tolist() == pytest.approx(s.tolist())
    assert importance_ratio(uneven, "average", log_s).tolist() == pytest.approx(((ratios + s) / 2).tolist())
    assert importance_ratio(uneven, "geometric_average", log_s).tolist() == pytest.approx(
        (ratios * s).sqrt().tolist())


def test_ppo_at_the_sequence_level_has_gspos_gradient() -> None:
    """Token by token, with the sequence's ratio through each token, the PPO loss's gradient is
    that of GSPO's per-sequence loss, -min(s_i A_i, clip(s_i) A_i), each sequence weighted alike."""
    logp_rollout = torch.tensor([-1.0, -2.0, -0.5, -1.5, -1.0])
    start = torch.tensor([-0.9, -2.1, -0.2, -1.6, -1.0])
    sequence_ids = torch.tensor([0, 0, 0, 1, 1])
    advantages = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0])
    lengths = torch.tensor([3.0, 3.0, 3.0, 2.0, 2.0])
    weights = 1 / lengths / 2  # w_t = (1 / |T_i|) / W, W = 2 sequences
    config = LossConfig("ppo", 0.2, 0.2, importance_sampling_level="sequence")
    logp_new = start.clone().requires_grad_()
    log_ratio = (logp_new - logp_rollout).detach()
    sequence = sequence_log_ratio(log_ratio, sequence_ids, torch.ones(5, dtype=torch.bool))
    policy_loss(logp_new, logp_rollout, advantages, weights, config, sequence=sequence).loss.backward()
    direct = start.clone().requires_grad_()
    total = torch.zeros(())
    for i, tokens in enumerate([slice(0, 3), slice(3, 5)]):
        s_i = torch.exp((direct[tokens] - logp_rollout[tokens]).mean())
        a_i = advantages[tokens][0]
        total = total - torch.minimum(s_i * a_i, s_i.clamp(0.8, 1.2) * a_i) / 2
    total.backward()
    assert logp_new.grad.tolist() == pytest.approx(direct.grad.tolist(), abs=1e-6)
    assert any(abs(g) > 1e-3 for g in logp_new.grad.tolist())


def test_ppo_refuses_the_mixed_levels_by_name() -> None:
    with pytest.raises(ValueError, match="'geometric_average' is offered with loss='cispo' only"):
        TrainConfig(loss="ppo", importance_sampling_level="geometric_average")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        TrainConfig(importance_sampling_level="per_token")


def test_kl_term_and_unknown_rollout_logprobs() -> None:
    logp_new = torch.tensor([-1.0])
    logp_ref = torch.tensor([-2.0])
    terms = policy_loss(logp_new, torch.tensor([math.nan]), torch.tensor([0.0]), torch.tensor([1.0]),
                        LossConfig(beta=0.1), logp_ref)
    kl = math.exp(-1.0) - (-1.0) - 1
    assert float(terms.kl) == pytest.approx(kl)
    assert float(terms.loss) == pytest.approx(0.1 * kl)  # advantage 0, ratio 1 where unknown


def test_a_token_the_policy_made_rare_pulls_the_kl_term_no_further_than_its_cap() -> None:
    """k3 on a token the reference finds likely (logp -0.1) and the policy rare (-12, -40) would be
    exp(11.9) ~ 1.5e5 and beyond; capped at 10 its gradient is 0 there (finite, not 0 * inf)."""
    logp_new = torch.tensor([-12.0, -40.0, -1.0], requires_grad=True)
    logp_ref = torch.tensor([-0.1, -0.1, -1.5])
    terms = policy_loss(logp_new, torch.tensor([math.nan] * 3), torch.zeros(3), torch.full((3,), 1 / 3),
                        LossConfig(beta=1.0), logp_ref)
    uncapped = math.exp(-0.5) + 0.5 - 1
    assert float(terms.kl) == pytest.approx((10 + 10 + uncapped) / 3)
    terms.loss.backward()
    assert logp_new.grad is not None and torch.isfinite(logp_new.grad).all()
    assert logp_new.grad[:2].tolist() == [0.0, 0.0]
    assert float(logp_new.grad[2]) == pytest.approx((1 - math.exp(-0.5)) / 3)  # d/dx of exp(r - x) - (r - x) - 1


def _choice(prompt: list[int], completion: list[int], logprobs: list[float] | None = None) -> Choice:
    lp = {"content": [{"token": "", "logprob": x} for x in logprobs]} if logprobs else None
    return Choice(message={"role": "assistant", "content": "x"}, prompt_token_ids=prompt, token_ids=completion,
                  logprobs=lp)


def test_turns_chain_on_exact_prefix_and_break_otherwise() -> None:
    trajectory = Trajectory(messages_and_choices=[
        {"role": "user", "content": "q"},
        _choice([1, 2], [3, 4], [-0.1, -0.2]),
        {"role": "tool", "content": "r", "tool_call_id": "a"},
        _choice([1, 2, 3, 4, 5], [6], [-0.3]),  # extends the running sequence
        _choice([9, 9], [7], [-0.4]),  # does not: a new sequence
    ], additional_histories=[History(messages_and_choices=[_choice([8], [8, 8])])])
    stats = TokenizeStats()
    sequences = tokenize_trajectory(trajectory, advantage=0.5, where="t", stats=stats, max_length=100)
    assert [s.token_ids for s in sequences] == [[1, 2, 3, 4, 5, 6], [9, 9, 7], [8, 8, 8]]
    assert sequences[0].assistant_mask == [False, False, True, True, False, True]
    assert sequences[0].logprobs[2:4] == [-0.1, -0.2] and math.isnan(sequences[0].logprobs[4])
    assert all(math.isnan(x) for x in sequences[2].logprobs)  # no logprobs captured: NaN (ratio 1)
    assert stats.prefix_breaks == 1 and stats.sequences == 3 and stats.assistant_tokens == 6
    assert {s.advantage for s in sequences} == {0.5}
    assert {s.weight for s in sequences} == {1 / 6}


def test_a_turn_without_token_ids_is_refused_with_the_fix() -> None:
    trajectory = Trajectory(messages_and_choices=[Choice(message={"role": "assistant", "content": "x"})])
    with pytest.raises(MissingTokensError, match="return_token_ids"):
        tokenize_trajectory(trajectory, 1.0, "group 0, trajectory 0", TokenizeStats(), 100)


def test_group_advantages() -> None:
    assert group_advantages([1.0, 1.0, 1.0], scale=True) is None
    assert group_advantages([2.0], scale=True) is None
    assert group_advantages([0.0, 1.0], scale=False) == [-0.5, 0.5]
    scaled = group_advantages([0.0, 1.0], scale=True)
    assert scaled == pytest.approx([-1.0, 1.0], abs=1e-5)


def test_metrics_must_be_numbers() -> None:
    with pytest.raises(ValueError, match="metric 'note' is 'hello'"):
        Trajectory(metrics={"note": "hello"})
    assert Trajectory(metrics={"ok": True, "n": 3, "x": 0.5}).metrics["ok"] is True


def test_rewards_and_settings_of_the_wrong_type_are_refused_not_coerced() -> None:
    for wrong in (True, "0.5"):
        with pytest.raises(ValueError, match="reward must be a number"):
            Trajectory(reward=wrong)
    assert Trajectory(reward=1).reward == 1.0
    with pytest.raises(ValueError, match="scale_rewards"):
        TrainConfig(scale_rewards=0)
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig.model_validate_json('{"learning_rate": "1e-5"}')
    assert TrainConfig(learning_rate=1).learning_rate == 1.0


def test_json_has_arts_trajectory_shape() -> None:
    trajectory = Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, _choice([1], [2], [-0.5])],
                            reward=1.0, metrics={"turns": 1}, metadata={"scenario": "s1"}, logs=["hi"],
                            additional_histories=[History(messages_and_choices=[{"role": "user", "content": "s"}])])
    data = trajectory.model_dump(mode="json")
    assert {"messages_and_choices", "additional_histories", "reward", "metrics", "metadata", "logs"} <= set(data)
    assert data["messages_and_choices"][1]["message"] == {"role": "assistant", "content": "x"}
    assert data["messages_and_choices"][1]["logprobs"]["content"][0]["logprob"] == -0.5
    again = Trajectory.model_validate_json(trajectory.model_dump_json())
    assert isinstance(again.messages_and_choices[1], Choice) and again == trajectory


def _trainer_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> object:
    """`load_trainable_model` as on a GPU, with peft's loader recorded instead of run (no GPU here)."""
    from art_backend.training import base_model as trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainer, "load_peft_model", lambda model_dir: ("peft", model_dir))
    monkeypatch.delitem(sys.modules, "art_backend.training.unsloth", raising=False)
    monkeypatch.delitem(sys.modules, "unsloth", raising=False)
    return trainer


def test_trainer_falls_back_to_peft_saying_why_when_unsloth_does_not_import(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # an installed Unsloth that refuses at import, as it does on GPUs and versions it does not support
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text('raise NotImplementedError("Unsloth: this GPU is not supported")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = _trainer_on_a_gpu(monkeypatch)
    with caplog.at_level(logging.INFO, logger="art_backend.training.base_model"):
        assert trainer.load_trainable_model(tmp_path / "model", 512) == ("peft", tmp_path / "model")
    assert "Unsloth is installed but does not import (NotImplementedError('Unsloth: this GPU is not supported'))" \
        in caplog.text
    assert "training with peft instead" in caplog.text


def test_trainer_on_a_gpu_without_unsloth_says_it_trains_with_peft(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer_on_a_gpu(monkeypatch)
    monkeypatch.setattr(trainer.importlib.util, "find_spec",
                        lambda name, *args: None if name == "unsloth" else importlib.util.find_spec(name, *args))
    with caplog.at_level(logging.INFO, logger="art_backend.training.base_model"):
        assert trainer.load_trainable_model(tmp_path, 512) == ("peft", tmp_path)
    assert "Unsloth is not installed" in caplog.text


def test_trainer_falls_back_to_peft_saying_why_when_unsloth_cannot_load_the_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Unsloth 2026.10.9 on the H100: it imports, then its loader refuses without bitsandbytes
    (tmp_path / "unsloth").mkdir()
    (tmp_path / "unsloth" / "__init__.py").write_text(
        "class FastLanguageModel:\n"
        "    @staticmethod\n"
        "    def from_pretrained(**kwargs):\n"
        "        raise ImportError('Unsloth: Please install bitsandbytes via `pip install bitsandbytes`')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = _trainer_on_a_gpu(monkeypatch)
    with caplog.at_level(logging.INFO, logger="art_backend.training.base_model"):
        assert trainer.load_trainable_model(tmp_path / "model", 512) == ("peft", tmp_path / "model")
    assert f"Unsloth imports but cannot load {tmp_path / 'model'} (ImportError('Unsloth: Please install " \
           "bitsandbytes" in caplog.text
    assert "training with peft instead" in caplog.text
