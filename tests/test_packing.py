"""Prefix-tree packing: a step's loss and LoRA gradients packed equal the unpacked ones, on real
captured trajectories (the main job's agent; a supervisor whose sub-agent trains as additional
histories, and a prefix break), and what the rows hold."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from art_backend.training.packing import pack
from art_backend.training.grpo import step_sequences
from art_backend.training.tokenize import TokenizeStats, TrainSequence
from art_backend.training import trainer as trainer_module
from art_backend.training.trainer import LoraTrainer, output_head
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup

FIXTURES = Path(__file__).parent / "fixtures"


def captured_sequences(fixture: str) -> tuple[list[TrainSequence], TokenizeStats]:
    """A stored step's groups (captured from a real run on the embedded model) as the trainer gets them."""
    groups = [TrajectoryGroup.model_validate_json(line) for line in (FIXTURES / fixture).read_text().splitlines()]
    stats = TokenizeStats()
    sequences, _, _ = step_sequences(groups, TrainConfig(), stats, vocabulary=49152)
    return sequences, stats


def with_a_prefix_break(sequences: list[TrainSequence]) -> list[TrainSequence]:
    """One more sequence as a prefix break leaves it: the first sequence's tokens with one token
    of its prompt re-spelled, from there on a sequence of its own that shares only the head."""
    first = sequences[0]
    broken = list(first.token_ids)
    broken[len(broken) // 3] = (broken[len(broken) // 3] + 1) % 49152
    return [*sequences, TrainSequence(broken, first.assistant_mask, first.logprobs, -first.advantage, first.weight)]


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path) -> LoraTrainer:
    torch.manual_seed(0)
    trainer = LoraTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    trainer._adapter("m", LoraConfig(), None)  # noqa: SLF001 - the adapter both ways are computed with
    assert trainer.peft is not None
    with torch.no_grad():  # B starts at zero, which would leave A's gradients zero: make both count
        for name, param in trainer.peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    return trainer


def _gradients(trainer: LoraTrainer, sequences: list[TrainSequence], config: TrainConfig,
               packing: bool) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    assert trainer.peft is not None
    trainer.packing = packing
    trainer.peft.zero_grad(set_to_none=True)
    sums = trainer.accumulate_gradients(sequences, config)
    return sums, {n: p.grad.clone() for n, p in trainer.peft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fixture", ["city_facts_step.jsonl", "supervisor_step.jsonl"])
def test_a_packed_step_has_the_unpacked_loss_and_gradients(trainer: LoraTrainer, fixture: str) -> None:
    sequences, _ = captured_sequences(fixture)
    if fixture == "supervisor_step.jsonl":  # each rollout's research sub-agent trains as a sequence of its own
        groups = [TrajectoryGroup.model_validate_json(line) for line in (FIXTURES / fixture).read_text().splitlines()]
        assert all(len(t.additional_histories) == 1 for g in groups for t in g.trajectories)
        assert len(sequences) == 2 * sum(len(g.trajectories) for g in groups)
    sequences = with_a_prefix_break(sequences)
    if fixture == "supervisor_step.jsonl":  # supervisor and sub-agent share nothing: two rows, padded
        assert max(b.token_ids.shape[0] for b in pack(sequences, 2048)) >= 2
    config = TrainConfig(temperature=0.7, beta=0.05, micro_batch_tokens=2048)
    packed_sums, packed = _gradients(trainer, sequences, config, packing=True)
    plain_sums, plain = _gradients(trainer, sequences, config, packing=False)
    assert packed_sums == pytest.approx(plain_sums, rel=1e-4, abs=1e-6)
    assert packed.keys() == plain.keys() and len(packed) == 2 * 7 * 2  # A and B of 7 projections, 2 layers
    for name, gradient in packed.items():
        torch.testing.assert_close(gradient, plain[name], rtol=1e-4, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for n, g in packed.items() if "lora_A" in n)


@pytest.mark.parametrize(("loss", "level"), [("ppo", "sequence"), ("cispo", "average"), ("cispo", "geometric_average")])
def test_a_sequence_level_ratio_is_the_same_packed_or_not_and_changes_the_step(
        trainer: LoraTrainer, monkeypatch: pytest.MonkeyPatch, loss: str, level: str) -> None:
    """Each sequence's ratio is taken over all its tokens before the chunked loss runs: packed
    (terms of several sequences in one tree) and padded (a row each) must agree, and differ
    from the token-level step."""
    sequences = with_a_prefix_break(captured_sequences("city_facts_step.jsonl")[0])
    monkeypatch.setattr(trainer_module, "LOGIT_CHUNK_TOKENS", 50)  # a sequence's tokens across chunks
    config = TrainConfig(loss=loss, importance_sampling_level=level, temperature=0.7, micro_batch_tokens=2048)
    packed_sums, packed = _gradients(trainer, sequences, config, packing=True)
    plain_sums, plain = _gradients(trainer, sequences, config, packing=False)
    assert packed_sums == pytest.approx(plain_sums, rel=1e-4, abs=1e-6)
    for name, gradient in packed.items():
        torch.testing.assert_close(gradient, plain[name], rtol=1e-4, atol=1e-7, msg=name)
    token_sums, _ = _gradients(trainer, sequences, config.model_copy(update={"importance_sampling_level": "token"}),
                               packing=True)
    assert abs(token_sums["policy_loss"] - packed_sums["policy_loss"]) > 1e-4


def test_logits_made_a_chunk_at_a_time_give_the_whole_logits_loss_and_gradients(
        trainer: LoraTrainer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(trainer.head, torch.nn.Linear)  # a Llama's logits are its lm_head's projection
    sequences, _ = captured_sequences("city_facts_step.jsonl")
    config = TrainConfig(temperature=0.7, beta=0.05, micro_batch_tokens=2048)
    monkeypatch.setattr(trainer_module, "LOGIT_CHUNK_TOKENS", 7)  # many chunks, the last one short
    chunked_sums, chunked = _gradients(trainer, sequences, config, packing=True)
    head, trainer.head = trainer.head, torch.nn.Identity()  # the whole model's logits, at once
    try:
        whole_sums, whole = _gradients(trainer, sequences, config, packing=True)
    finally:
        trainer.head = head
    assert chunked_sums == pytest.approx(whole_sums, rel=1e-4, abs=1e-6)
    for name, gradient in chunked.items():
        torch.testing.assert_close(gradient, whole[name], rtol=1e-4, atol=1e-7, msg=name)


def test_checkpointed_activations_give_the_same_loss_and_gradients(trainer: LoraTrainer) -> None:
    sequences, _ = captured_sequences("city_facts_step.jsonl")
    config = TrainConfig(temperature=0.7, beta=0.05, micro_batch_tokens=2048)
    assert trainer.peft is not None
    trainer.peft.train()  # checkpointing applies in training mode only, as in a step
    try:
        trainer._checkpoint_activations(True)  # noqa: SLF001
        assert trainer.base.model.layers[0].gradient_checkpointing
        checkpointed_sums, checkpointed = _gradients(trainer, sequences, config, packing=True)
        trainer._checkpoint_activations(False)  # noqa: SLF001
        assert not trainer.base.model.layers[0].gradient_checkpointing
        kept_sums, kept = _gradients(trainer, sequences, config, packing=True)
    finally:
        trainer.peft.eval()
    assert checkpointed_sums == pytest.approx(kept_sums, rel=1e-5, abs=1e-7)
    for name, gradient in checkpointed.items():
        torch.testing.assert_close(gradient, kept[name], rtol=1e-5, atol=1e-8, msg=name)


def test_adapter_and_checkpointing_set_up_without_deprecation_warnings(tiny_model_dir: Path) -> None:
    """transformers 5 deprecated `gradient_checkpointing_*` and `is_gradient_checkpointing` (peft reads it):
    every `make run` printed their warnings at the first step."""
    trainer = LoraTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        trainer._adapter("m", LoraConfig(), None)  # noqa: SLF001
        trainer._checkpoint_activations(True)  # noqa: SLF001
        assert trainer.base.model.layers[0].gradient_checkpointing
        trainer._checkpoint_activations(False)  # noqa: SLF001
        assert not trainer.base.model.layers[0].gradient_checkpointing


def test_a_model_that_post_processes_its_logits_keeps_the_whole_forward(tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert output_head(model) is model.get_output_embeddings()
    model.register_forward_hook(lambda module, args, output: output.__class__(logits=torch.tanh(output.logits)))
    assert isinstance(output_head(model), torch.nn.Identity)  # as Gemma 2's soft-capping would be


def test_rows_hold_each_shared_token_once_and_every_trained_token_as_a_term() -> None:
    sequences, _ = captured_sequences("city_facts_step.jsonl")
    (batch,) = pack(sequences, 4096)  # the groups share their head: one tree
    assert batch.tokens < sum(len(s) for s in sequences) / 4
    assert len(batch.term_targets) == sum(sum(s.assistant_mask[1:]) for s in sequences)
    (parents,) = batch.parents  # each term's predicting token is the target's predecessor in its sequence
    assert all(parents[int(p)] < int(p) for p in batch.term_positions if parents[int(p)] >= 0)
    small = pack(sequences, 1024)
    assert max(b.tokens for b in small) <= 1024 < max(len(s) for s in sequences) * 2


def _tiny(length: int, value: float) -> TrainSequence:
    return TrainSequence(list(range(length)), [False] * (length - 1) + [True], [math.nan] * length, value, 1.0)


def test_the_mask_lets_a_token_see_exactly_its_own_path() -> None:
    (batch,) = pack([_tiny(3, 1.0), TrainSequence([0, 1, 7], [False, False, True], [math.nan] * 3, -1.0, 1.0)], 16)
    assert batch.token_ids.tolist() == [[0, 1, 2, 7]] and batch.positions.tolist() == [[0, 1, 2, 2]]
    allowed = (batch.attention_bias(torch.float32)[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 1]]
    assert batch.term_positions.tolist() == [1, 1] and sorted(batch.term_targets.tolist()) == [2, 7]


def test_sequences_that_share_nothing_keep_rows_of_their_own_batched_with_padding() -> None:
    # merged, a row of 16 would make every token attend over twice the length for nothing
    apart = [TrainSequence(list(range(start, start + 8)), [False] * 7 + [True], [math.nan] * 8, 1.0, 1.0)
             for start in (0, 100)]
    short = TrainSequence(list(range(200, 205)), [False] * 4 + [True], [math.nan] * 5, -1.0, 1.0)
    (batch,) = pack([*apart, short], 64)
    assert batch.token_ids.shape == (3, 8) and [len(p) for p in batch.parents] == [8, 8, 5]
    allowed = batch.attention_bias(torch.float32)[2, 0] == 0  # padding attends to itself only
    assert allowed[5:, :].int().tolist() == torch.eye(8, dtype=torch.int)[5:].tolist()
    assert batch.term_rows.tolist() == [0, 1, 2]


def test_a_sequence_longer_than_the_budget_gets_a_row_of_its_own() -> None:
    batches = pack([_tiny(10, 1.0), _tiny(3, -1.0)], 4)
    assert sorted(b.token_ids.shape[1] for b in batches) == [3, 10]
