"""`TrainableModel`: a LoRA policy trained and served by a backend."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from openai import AsyncOpenAI
from pydantic import BaseModel, Field, PrivateAttr

from art_integrations.backend import Backend
from art_integrations.observability.wandb import WandbReporter, reporter_for
from art_integrations.training import LoraConfig, TrainConfig
from art_integrations.trajectory import TrajectoryGroup


class TrainResult(BaseModel):
    step: int
    metrics: dict[str, Any]


class TrainableModel(BaseModel):
    """A model trained with GRPO: `name` is served as the newest policy, `name@N` as step N."""

    name: str
    project: str
    base_model: str | None = None  # None: whatever the backend serves
    lora: LoraConfig = Field(default_factory=LoraConfig)
    # ["wandb"]: log each step's metrics to W&B; None: only if WANDB_API_KEY or WANDB_MODE is set
    report_metrics: list[Literal["wandb"]] | None = None
    _backend: Backend | None = PrivateAttr(default=None)
    _reporter: WandbReporter | None = PrivateAttr(default=None)

    async def register(self, backend: Backend, *, fall_back: bool = False) -> None:
        """Attach to `backend`; a model trained before resumes from its newest checkpoint. If that
        checkpoint does not load (damaged on disk), registering fails and says what is wrong;
        `fall_back=True` then moves the damaged steps aside (kept on disk) and resumes from the
        newest step that loads."""
        answer = await backend.request("POST", "/v1/training/models", {
            "project": self.project, "name": self.name, "base_model": self.base_model,
            "lora": self.lora.model_dump(), "fall_back": fall_back})
        self.base_model = answer["base_model"]
        self._backend = backend
        self._reporter = self._reporter or reporter_for(self)

    @property
    def metrics_reporter(self) -> WandbReporter | None:
        """Where `train` and `log` results go besides history.jsonl (its `errors`, `finish()`)."""
        return self._reporter

    async def _report(self, step: int, split: str, metrics: dict[str, Any]) -> None:
        if self._reporter is not None:  # wandb calls block: keep them off the event loop
            await asyncio.to_thread(self._reporter.log, step, split, metrics)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"Model {self.name!r} is not registered: call `await model.register(backend)` first.")
        return self._backend

    @property
    def inference_name(self) -> str:
        return self.name

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` pointed at the backend; use `model=model.inference_name`."""
        return self.backend.openai_client(**kwargs)

    def _path(self, action: str) -> str:
        return f"/v1/training/models/{self.project}/{self.name}/{action}"

    async def get_step(self) -> int:
        return (await self.backend.request("GET", self._path("step")))["step"]

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | None = None) -> TrainResult:
        """One GRPO step on `groups`; the new checkpoint is served before this returns. Groups that
        `gather_trajectory_groups` dropped are counted in the step's metrics, with their reasons."""
        body = {"groups": [g.model_dump(mode="json") for g in groups],
                "config": (config or TrainConfig()).model_dump(),
                "dropped": [d["reason"] for d in getattr(groups, "dropped", [])]}
        result = TrainResult.model_validate(await self.backend.request("POST", self._path("train"), body))
        await self._report(result.step, "train", result.metrics)
        return result

    async def log(self, groups: list[TrajectoryGroup], split: str = "val") -> dict[str, Any]:
        """Record metrics and trajectories of `groups` at the current step without training."""
        body = {"groups": [g.model_dump(mode="json") for g in groups], "split": split}
        answer = await self.backend.request("POST", self._path("log"), body)
        await self._report(answer["step"], split, answer["metrics"])
        return answer["metrics"]

    async def history(self) -> list[dict[str, Any]]:
        return await self.backend.request("GET", self._path("history"))

    async def delete_checkpoints(self, best_metric: str = "reward/mean", best_split: str = "val") -> dict[str, Any]:
        """Delete all checkpoints except the latest and the best by `best_metric` in `best_split`."""
        return await self.backend.request("POST", self._path("delete_checkpoints"),
                                          {"best_metric": best_metric, "best_split": best_split})
