"""HTTP routes of the training service (under /v1/training), used by art_integrations' backends."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from fastapi import Path as PathParameter
from pydantic import AfterValidator, BaseModel, Field, model_validator

from art_backend.protocol import refuse_lone_surrogates
from art_backend.training import sync
from art_backend.training.service import TrainingService
from art_integrations.training import LoraConfig, TrainConfig, TrainSFTConfig
from art_integrations.trajectory import Trajectory, TrajectoryGroup


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def checked_name(name: str) -> str:
    """Project, model and split names become directory and file names under the art dir (and
    served model names): so never a path, `..`, hidden, or anything a file system may refuse."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name[:120]!r} is not a name here: use letters, digits, '.', '_' and '-', starting "
                         "with a letter or digit, at most 100 characters")
    return name


Name = Annotated[str, AfterValidator(checked_name)]
NameInPath = Annotated[str, PathParameter(), AfterValidator(checked_name)]


class _Body(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        return refuse_lone_surrogates(data)


class RegisterBody(_Body):
    project: Name
    name: Name
    base_model: str | None = None
    lora: LoraConfig = Field(default_factory=LoraConfig)
    fall_back: bool = Field(default=False, description="if the newest checkpoint does not load, move the damaged "
                            "steps aside and continue from the newest one that does")
    trainable: bool = Field(default=True, description="false: a model only scored beside the trained ones (ART's "
                            "`art.Model`): its logged metrics are recorded; nothing is served or trained")


# numbers a client records with a step or a logged split under names of its own (a pipeline's staleness)
ClientMetrics = dict[str, Annotated[float, Field(allow_inf_nan=False, strict=True)]]  # "1" or true refused


class TrainBody(_Body):
    groups: list[TrajectoryGroup]
    config: TrainConfig = Field(default_factory=TrainConfig)
    dropped: list[str] = Field(default_factory=list, description="why groups were dropped before training")
    metrics: ClientMetrics = Field(default_factory=dict, description="the client's own numbers for this step, "
                                   "recorded with it (a name the step itself records is refused)")
    state: dict[str, Any] | None = Field(default=None, description="what the client needs to resume after this step "
                                         "(PipelineTrainer's place in its scenarios), kept in the step's record as "
                                         "`client_state`, committed with the checkpoint")


class TrainSFTBody(_Body):
    trajectories: list[Trajectory] = Field(min_length=1, description="demonstrations: with the exact token ids of "
                                           "captured turns, or messages only (rendered with the model's template)")
    config: TrainSFTConfig = Field(default_factory=TrainSFTConfig)


class LogBody(_Body):
    groups: list[TrajectoryGroup] = Field(default_factory=list)
    split: Name = "val"
    step: int | None = Field(default=None, ge=0, strict=True, description="the step these scores are of (an eval "
                             "that ran while later steps trained); default: the newest")
    metrics: ClientMetrics = Field(default_factory=dict)


class PushBody(_Body):
    url: str = Field(description="an fsspec URL used as an art dir in storage (s3://bucket/prefix, file:///path, ...): "
                     "the model goes to <url>/<project>/models/<name>/")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec's options for the store "
                                            "(e.g. {\"endpoint_url\": ...}); credentials are best left to the "
                                            "backend machine's own (AWS_* variables, its role)")
    delete: bool = Field(default=False, description="also remove from the store the steps and files the art dir "
                         "no longer has (after delete_checkpoints)")


class PullBody(_Body):
    url: str
    storage_options: dict[str, Any] = Field(default_factory=dict)
    step: int | Literal["latest"] | None = Field(default=None, description="one step, the newest, or all (None)")
    exclude: set[sync.Part] = Field(default_factory=set, description="parts left in the store")


def _absolute_path(path: str) -> str:
    """The backend writes where it runs: a relative path would land in its working directory."""
    if "\x00" in path or not Path(path).is_absolute():
        raise ValueError(f"{path[:200]!r} is not an absolute path on the backend's machine: name the folder to "
                         "write from the root (e.g. /srv/models/agent-step3)")
    return path


class ExportBody(_Body):
    format: Literal["adapter", "merged", "gguf"] = Field(description="adapter: peft's layout (vLLM --lora-modules, "
                                                         "peft); merged: safetensors (transformers, vLLM); gguf: "
                                                         "llama.cpp's converter, with an Ollama Modelfile")
    out: Annotated[str, AfterValidator(_absolute_path)] = Field(
        max_length=4096, description="the folder to write, on the backend's machine: new, or empty")
    step: int | None = Field(default=None, ge=0, description="the step to export; None: the newest")
    quant: str | None = Field(default=None, max_length=32, description="gguf only: f16 (default), bf16, f32, q8_0, or "
                              "a type llama-quantize makes (e.g. q4_k_m)")
    modelfile: bool = Field(default=True, description="gguf only: write an Ollama Modelfile beside the GGUF")


class DeleteCheckpointsBody(_Body):
    best_metric: str = "reward/mean"
    best_split: str = "val"


def training_router(service: TrainingService) -> APIRouter:
    router = APIRouter(prefix="/v1/training")

    @router.post("/models")
    async def register(body: RegisterBody) -> dict[str, Any]:
        if not body.trainable:
            return await service.register_scored(body.project, body.name)
        return await service.register(body.project, body.name, body.base_model, body.lora, body.fall_back)

    @router.get("/models/{project}/{name}/step")
    async def get_step(project: NameInPath, name: NameInPath) -> dict[str, int]:
        return {"step": service.get_step(project, name)}

    @router.post("/models/{project}/{name}/train")
    async def train(project: NameInPath, name: NameInPath, body: TrainBody) -> dict[str, Any]:
        return await service.train(project, name, body.groups, body.config, body.dropped, body.metrics, body.state)

    @router.post("/models/{project}/{name}/train_sft")
    async def train_sft(project: NameInPath, name: NameInPath, body: TrainSFTBody) -> dict[str, Any]:
        return await service.train_sft(project, name, body.trajectories, body.config)

    @router.post("/models/{project}/{name}/log")
    async def log(project: NameInPath, name: NameInPath, body: LogBody) -> dict[str, Any]:
        return await service.log(project, name, body.groups, body.split, body.step, body.metrics)

    @router.get("/models/{project}/{name}/history")
    async def history(project: NameInPath, name: NameInPath) -> list[dict[str, Any]]:
        return service.history(project, name)

    @router.post("/models/{project}/{name}/delete_checkpoints")
    async def delete_checkpoints(project: NameInPath, name: NameInPath, body: DeleteCheckpointsBody) -> dict[str, Any]:
        return await service.delete_checkpoints(project, name, body.best_metric, body.best_split)

    @router.post("/models/{project}/{name}/export")
    async def export(project: NameInPath, name: NameInPath, body: ExportBody) -> dict[str, Any]:
        return await service.export(project, name, body.step, body.format, Path(body.out), body.quant, body.modelfile)

    @router.post("/models/{project}/{name}/push")
    async def push(project: NameInPath, name: NameInPath, body: PushBody) -> dict[str, Any]:
        return await service.push(project, name, body.url, body.storage_options, body.delete)

    @router.post("/models/{project}/{name}/pull")
    async def pull(project: NameInPath, name: NameInPath, body: PullBody) -> dict[str, Any]:
        return await service.pull(project, name, body.url, body.storage_options, body.step, body.exclude)

    return router
