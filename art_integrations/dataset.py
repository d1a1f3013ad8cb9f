"""Walking a fixed list of scenarios in training steps, epoch after epoch (ART's `iterate_dataset`).

    for batch in iterate_dataset(scenarios, groups_per_step=4, num_epochs=3, initial_step=await model.get_step()):
        groups = [trajectory_group(lambda s=s: rollout(model, s), n=8) for s in batch.items]

Each epoch visits every scenario once in an order shuffled by the epoch number alone (the same
order ART gives), so a resumed run (`initial_step`) continues exactly where it stopped.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")


@dataclass
class DatasetBatch(Generic[Item]):
    items: list[Item]
    step: int  # the training step this batch is for, counted over all epochs
    epoch: int
    epoch_step: int


def iterate_dataset(dataset: Sequence[Item], groups_per_step: int = 1, num_epochs: int = 1, initial_step: int = 0,
                    use_tqdm: bool = True) -> Iterator[DatasetBatch[Item]]:
    """Batches of `groups_per_step` scenarios (the last of an epoch may be smaller), from step
    `initial_step` on, with a progress bar over all steps unless `use_tqdm=False`."""
    for name, value, least in (("groups_per_step", groups_per_step, 1), ("num_epochs", num_epochs, 0),
                               ("initial_step", initial_step, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
    if not dataset:
        return
    steps_per_epoch = math.ceil(len(dataset) / groups_per_step)
    bar = tqdm(initial=min(initial_step, steps_per_epoch * num_epochs), total=steps_per_epoch * num_epochs,
               desc="dataset", unit="step", disable=not use_tqdm)
    try:
        for epoch in range(initial_step // steps_per_epoch, num_epochs):
            order = list(range(len(dataset)))
            random.Random(epoch).shuffle(order)
            for epoch_step in range(steps_per_epoch):
                step = epoch * steps_per_epoch + epoch_step
                if step < initial_step:
                    continue
                chosen = order[epoch_step * groups_per_step:(epoch_step + 1) * groups_per_step]
                yield DatasetBatch([dataset[i] for i in chosen], step, epoch, epoch_step)
                bar.update(1)
    finally:
        bar.close()
