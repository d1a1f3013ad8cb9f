"""HTTP routes of the training service (under /v1/training), used by art_integrations' backends."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from art_backend.training.service import TrainingService
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup


class RegisterBody(BaseModel):
    project: str = Field(min_length=1)
    name: str = Field(min_length=1)
    base_model: str | None = None
    lora: LoraConfig = Field(default_factory=LoraConfig)
    fall_back: bool = Field(default=False, description="if the newest checkpoint does not load, move the damaged "
                            "steps aside and continue from the newest one that does")


class TrainBody(BaseModel):
    groups: list[TrajectoryGroup]
    config: TrainConfig = Field(default_factory=TrainConfig)
    dropped: list[str] = Field(default_factory=list, description="why groups were dropped before training")


class LogBody(BaseModel):
    groups: list[TrajectoryGroup]
    split: str = "val"


class DeleteCheckpointsBody(BaseModel):
    best_metric: str = "reward/mean"
    best_split: str = "val"


def training_router(service: TrainingService) -> APIRouter:
    router = APIRouter(prefix="/v1/training")

    @router.post("/models")
    async def register(body: RegisterBody) -> dict[str, Any]:
        return await service.register(body.project, body.name, body.base_model, body.lora, body.fall_back)

    @router.get("/models/{project}/{name}/step")
    async def get_step(project: str, name: str) -> dict[str, int]:
        return {"step": service.get_step(project, name)}

    @router.post("/models/{project}/{name}/train")
    async def train(project: str, name: str, body: TrainBody) -> dict[str, Any]:
        return await service.train(project, name, body.groups, body.config, body.dropped)

    @router.post("/models/{project}/{name}/log")
    async def log(project: str, name: str, body: LogBody) -> dict[str, Any]:
        return await service.log(project, name, body.groups, body.split)

    @router.get("/models/{project}/{name}/history")
    async def history(project: str, name: str) -> list[dict[str, Any]]:
        return service.history(project, name)

    @router.post("/models/{project}/{name}/delete_checkpoints")
    async def delete_checkpoints(project: str, name: str, body: DeleteCheckpointsBody) -> dict[str, Any]:
        return await service.delete_checkpoints(project, name, body.best_metric, body.best_split)

    return router
