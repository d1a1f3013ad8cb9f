"""The functions a pipeline is made of, in ART's names (`art.pipeline_trainer.types`), and
`make_group_rollout_fn`, a group rollout from a single one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from art_integrations.trajectory import Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from art_integrations.model import TrainableModel

ScenarioT = TypeVar("ScenarioT")
ConfigT = TypeVar("ConfigT")
RolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[TrajectoryGroup]]
SingleRolloutFn = Callable[["TrainableModel", ScenarioT, ConfigT], Awaitable[Trajectory]]
EvalFn = Callable[["TrainableModel", int, ConfigT],
                  Awaitable[Sequence[Trajectory | TrajectoryGroup] | Mapping[str, Sequence[Trajectory | TrajectoryGroup]]]]


def make_group_rollout_fn(single_rollout_fn: SingleRolloutFn[ScenarioT, ConfigT], n: int = 4
                          ) -> RolloutFn[ScenarioT, ConfigT]:
    """A group rollout from a single one: `n` of them at once, each failure kept in the group's `exceptions`."""
    async def group_rollout(model: TrainableModel, scenario: ScenarioT, config: ConfigT) -> TrajectoryGroup:
        return await TrajectoryGroup([single_rollout_fn(model, scenario, config) for _ in range(n)])

    return group_rollout
