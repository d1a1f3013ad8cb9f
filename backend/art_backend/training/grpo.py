"""One GRPO step, top to bottom.

For the groups of a step (each the G trajectories of one scenario, with rewards r_1..r_G):

1. Group advantages: every trajectory is scored against the others of its group,

       A_i = (r_i - mean(r)) / (std(r) + 1e-6)       (scale_rewards=False: A_i = r_i - mean(r))

   and a group whose rewards are all equal carries no signal: it is skipped.

2. Sequences and token weights (tokenize.py): each trajectory's model turns become token
   sequences from their exact rollout ids, trained on the tokens the policy produced (T_i), each
   with its trajectory's A_i and rollout logprob. Every trajectory counts the same however long
   it is, and the step's weights sum to 1:

       w_t = (1 / |T_i|) / W          for t in T_i, W = the sum of 1 / |T_i| over every trained token
                                      (the number of trajectories trained, less what truncation cut)

3. The loss (loss.py; CISPO by default, PPO-clip as an option, an optional KL to the base
   model or to one of the model's own checkpoints):

       loss = sum_t w_t * loss_t(ratio_t, A_t)      ratio_t = exp(logp_new_t - logp_rollout_t)

   taken micro-batch by micro-batch (prefix trees: packing.py), the gradients accumulating
   (`LoraTrainer.accumulate_gradients`, whose logits are made a chunk of tokens at a time to save
   memory).

4. The update: the gradient's norm clipped to max_grad_norm, then one AdamW step on the adapter;
   the adapter and the optimizer's state are written to the step's checkpoint.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from art_backend.errors import TrainingRequestError
from art_backend.training.tokenize import TokenizeStats, TrainSequence, tokenize_trajectory
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup, rewards_differ

if TYPE_CHECKING:  # the training service imports this module; peft only comes with the first step
    from art_backend.training.trainer import LoraTrainer


def group_advantages(rewards: list[float], scale: bool) -> list[float] | None:
    """Step 1: A = (r - mean) / (std + 1e-6) per group (std division optional); None when all
    rewards are equal: such a group carries no signal."""
    if not rewards_differ(rewards):
        return None
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards)
    return [(r - mean) / (std + 1e-6) if scale else r - mean for r in rewards]


def step_sequences(groups: list[TrajectoryGroup], config: TrainConfig, stats: TokenizeStats,
                   vocabulary: int) -> tuple[list[TrainSequence], int, int]:
    """Steps 1 and 2: the sequences a step trains on (each with its trajectory's group advantage
    and token weight 1 / |T_i|), and how many groups were trained and skipped (no signal)."""
    sequences: list[TrainSequence] = []
    trained = skipped = 0
    for g, group in enumerate(groups):
        advantages = group_advantages([t.reward for t in group.trajectories], config.scale_rewards)
        if advantages is None:
            skipped += 1
            continue
        trained += 1
        for i, (trajectory, advantage) in enumerate(zip(group.trajectories, advantages)):
            try:
                tokenized = tokenize_trajectory(trajectory, advantage, f"group {g}, trajectory {i}", stats,
                                                config.max_sequence_length)
            except ValueError as error:
                raise TrainingRequestError(str(error)) from error
            foreign = sorted({t for s in tokenized for t in s.token_ids if not 0 <= t < vocabulary})
            if foreign:
                raise TrainingRequestError(
                    f"group {g}, trajectory {i}: token ids {foreign[:5]} are outside this model's vocabulary "
                    f"(0..{vocabulary - 1}): they did not come from this backend's model. Capture the tokens of "
                    "its own replies (`return_token_ids`).")
            sequences += tokenized
    return sequences, trained, skipped


def grpo_step(trainer: LoraTrainer, model_name: str, sequences: list[TrainSequence], config: TrainConfig,
              lora: LoraConfig, resume_from: Path | None, save_to: Path,
              kl_reference: Path | None = None) -> dict[str, float]:
    """Steps 3 and 4 on `model_name`'s adapter (continuing from `resume_from` if it is not in
    memory), the checkpoint written to `save_to`; `kl_reference`: the checkpoint the KL term is
    measured against (None: the base model). A step without sequences (no group with signal)
    leaves the adapter and optimizer as they were, and still writes its checkpoint."""
    started = time.perf_counter()
    metrics: dict[str, float] = {}
    with trainer.updating(model_name, lora, resume_from, save_to, config.gradient_checkpointing) as update:
        if sequences:
            # step 3 (divides by W)
            metrics = trainer.accumulate_gradients(sequences, config, kl_reference=kl_reference)
            metrics["grad_norm"] = update.step(config.learning_rate, config.max_grad_norm)  # step 4
    return {**metrics, "train_seconds": time.perf_counter() - started}
