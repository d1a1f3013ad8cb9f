"""`--pipeline`: the job's GRPO steps trained by ART's PipelineTrainer, so the next steps' rollouts
run (and wait on their tools and judge) while a step trains. The same scenarios in the same
order, each rollout with the same sampling seed as in the synchronous loop: what differs is only
that a group may be sampled by a checkpoint up to `--max-steps-off-policy` steps older than the
one it trains."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from art_integrations import TrainableModel, TrainConfig, TrajectoryGroup
from art_integrations.pipeline_trainer import PipelineTrainer
from examples.runner import AfterEach, Example, Policy, Scenario, seeded_rollouts


async def pipelined_steps(example: Example, args: argparse.Namespace, model: TrainableModel, policy: Policy,
                          scenarios: Sequence[Scenario], after_each: AfterEach | None, first_step: int,
                          config: TrainConfig) -> None:
    """Steps `first_step` to `args.steps`: a scenario's place in `scenarios` gives the step and slot
    its rollouts are seeded as in the synchronous loop; resuming skips what the pipeline's ledger
    (committed with each step) says is done."""

    async def rollout_fn(model: TrainableModel, numbered: tuple[int, Scenario], config: None) -> TrajectoryGroup:
        index, scenario = numbered
        step, slot = divmod(index, args.scenarios_per_step)
        rollout = seeded_rollouts(example, policy, scenario, args.seed, step, slot)
        group: TrajectoryGroup = await TrajectoryGroup([rollout() for _ in range(args.rollouts)],
                                                       metadata={"scenario": scenario.id})
        if after_each is not None and group.trajectories:
            scored = await after_each(group)
            if scored is None:  # counts against the exception budget, as a failed rollout does
                raise RuntimeError(f"the judge could not score scenario {scenario.id}'s group (see its log above)")
            group = scored
        return group

    # (bound + 1) steps' worth of workers: as many groups as can run and still train within the bound
    workers = (args.max_steps_off_policy + 1) * args.scenarios_per_step
    trainer: PipelineTrainer[tuple[int, Scenario], None] = PipelineTrainer(
        model, model.backend, rollout_fn, list(enumerate(scenarios)), None, num_rollout_workers=workers,
        min_batch_size=args.scenarios_per_step, max_batch_size=args.scenarios_per_step,
        max_steps=args.steps - first_step, max_steps_off_policy=args.max_steps_off_policy, train_config=config,
        max_exceptions=0.1, total_scenarios=len(scenarios), log_interval_seconds=30)
    await trainer.train()
