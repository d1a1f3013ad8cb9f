"""`TrainableModel`: a LoRA policy trained and served by a backend; `Model`: one only scored beside it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from openai import AsyncOpenAI
from pydantic import Field, PrivateAttr

from art_integrations.art_compat import names
from art_integrations.art_compat.config import from_internal_config, from_lora_config, train_config_with
from art_integrations.backend import Backend, LocalBackend
from art_integrations.observability.wandb import WandbReporter, reporter_for
from art_integrations.strict import StrictModel
from art_integrations.training import LoraConfig, TrainConfig, TrainResult, TrainSFTConfig
from art_integrations.trajectory import Trajectory, TrajectoryGroup


ExportFormat = Literal["adapter", "merged", "gguf"]


class Model(StrictModel):
    """A model rolled out and scored beside the trained one (ART's `art.Model`): a prompted model at
    any OpenAI-compatible endpoint (`inference_base_url`, `inference_api_key`,
    `inference_model_name`). Registered with a backend, `log()` records its scores in the same
    history, so curves compare."""

    ART_NAMES: ClassVar[dict[str, str]] = names.MODEL_FIELDS
    ART_METHODS: ClassVar[dict[str, str]] = names.MODEL_METHODS

    name: str
    project: str
    inference_model_name: str | None = None  # None: `name`
    inference_base_url: str | None = None
    inference_api_key: str | None = None
    # the script's own settings (ART's `config`, e.g. max turns): kept on the model for the rollouts to read;
    # neither the backend nor W&B sees it
    config: Any = None
    # ["wandb"]: log each step's metrics to W&B; None: only if WANDB_API_KEY or WANDB_MODE is set
    report_metrics: list[Literal["wandb"]] | None = None
    _backend: Backend | None = PrivateAttr(default=None)
    _reporter: WandbReporter | None = PrivateAttr(default=None)

    def __getattr__(self, name: str) -> Any:
        names.refuse_art_name(type(self).__name__, name, type(self).ART_METHODS, "method")
        return super().__getattr__(name)  # pydantic's: private attributes, then the plain AttributeError

    async def register(self, backend: Backend) -> None:
        """Record this model's logged scores on `backend` (nothing is served or trained for it)."""
        await backend.request("POST", "/v1/training/models", {"project": self.project, "name": self.name,
                                                              "trainable": False})
        self._attach(backend)

    def _attach(self, backend: Backend) -> None:
        self._backend = backend
        self._reporter = self._reporter or reporter_for(self.project, self.name, self.report_metrics,
                                                        self._run_config())

    def _run_config(self) -> dict[str, Any]:
        """What a W&B run of this model records as its config."""
        return {"inference_model_name": self.inference_name, "inference_base_url": self.inference_base_url}

    def __getstate__(self) -> dict[Any, Any]:
        # Pickled (a rollout sent to a Ray worker), the model keeps its backend (which travels as its
        # URL and key) but not its W&B reporter: the run that reports metrics is this process's.
        state = super().__getstate__()
        return {**state, "__pydantic_private__": {**(state["__pydantic_private__"] or {}), "_reporter": None}}

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
        return self.inference_model_name or self.name

    def get_inference_name(self, step: int | None = None) -> str:
        return self.inference_name

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` at `inference_base_url`; use `model=model.get_inference_name()`. At the
        registered backend's endpoint it is the backend's own (`Backend.openai_client`: one per event
        loop, closed with the backend)."""
        if self.inference_base_url is None:
            raise RuntimeError(f"Model {self.name!r} has no inference_base_url: set it to the endpoint that serves "
                               f"{self.inference_name!r}.")
        if self._backend is not None and self.inference_base_url == f"{self._backend.base_url}/v1" \
                and self.inference_api_key == (self._backend.api_key or "unused"):
            return self._backend.openai_client(**kwargs)
        return AsyncOpenAI(base_url=self.inference_base_url, api_key=self.inference_api_key or "unused", **kwargs)

    def _path(self, action: str) -> str:
        return f"/v1/training/models/{self.project}/{self.name}/{action}"

    async def get_step(self) -> int:
        return (await self.backend.request("GET", self._path("step")))["step"]

    async def log(self, trajectories: Iterable[TrajectoryGroup] | Iterable[Trajectory | BaseException] | None = None,
                  split: str = "val", *, metrics: Mapping[str, float] | None = None,
                  step: int | None = None) -> dict[str, Any]:
        """Record the scores and trajectories of groups (or of loose trajectories, as one group) and
        `metrics` of your own, at `step` (default: the newest; an eval of an older checkpoint
        that ran while training went on names its step), without training. ART's signature."""
        items = list(trajectories or ())
        groups = [item for item in items if isinstance(item, TrajectoryGroup)]
        if len(groups) != len(items):
            if groups:
                raise TypeError("log() takes groups or trajectories, not both mixed: pass [group, ...] or "
                                "[trajectory, ...]")
            groups = [TrajectoryGroup(items)]
        body = {"groups": [g.model_dump(mode="json") for g in groups], "split": split,
                "metrics": dict(metrics or {}), "step": step}
        answer = await self.backend.request("POST", self._path("log"), body)
        await self._report(answer["step"], split, answer["metrics"])
        return answer["metrics"]

    async def history(self) -> list[dict[str, Any]]:
        return await self.backend.request("GET", self._path("history"))


class TrainableModel(Model):
    """A model trained with GRPO (`train`) and SFT (`train_sft`): `name` is served as the newest
    policy, `name@N` as step N. Once registered, `inference_base_url`, `inference_api_key` and
    `inference_model_name` point at the backend, as in ART.

    ART's `lora_config=art.dev.LoRAConfig(...)` (0.5.23) sets `lora`; ART's `_internal_config`
    (an argument, or set on the model before `register`) is read when it registers: its LoRA
    settings set `lora`, its engine settings go to the backend (`Backend.take_engine_settings`),
    and what means nothing here is refused by name (`art_compat/config.py`)."""

    ART_NAMES: ClassVar[dict[str, str]] = names.TRAINABLE_MODEL_FIELDS

    base_model: str | None = None  # None: whatever the backend serves
    lora: LoraConfig = Field(default_factory=LoraConfig)
    _internal_config: Mapping[str, Any] | None = PrivateAttr(default=None)

    def __init__(self, **data: Any) -> None:
        internal = data.pop("_internal_config", None)
        if data.get("run_name") == data.get("name"):  # ART 0.5.23's storage name: the same thing here
            data.pop("run_name")
        lora_config = data.pop("lora_config", None)
        if lora_config is not None:
            if "lora" in data:
                raise ValueError("lora= and lora_config= (ART's name) both set the adapter: pass one")
            data["lora"] = LoraConfig(**from_lora_config(lora_config).lora)
        super().__init__(**data)
        self._internal_config = internal

    async def register(self, backend: Backend, *, fall_back: bool = False) -> None:
        """Attach to `backend`; a model trained before resumes from its newest checkpoint. If that
        checkpoint does not load (damaged on disk), registering fails and says what is wrong;
        `fall_back=True` then moves the damaged steps aside (kept on disk) and resumes from the
        newest step that loads."""
        self._take_internal_config(backend)
        await backend._ensure_started(self.base_model)  # a LocalBackend started lazily serves this base model
        answer = await backend.request("POST", "/v1/training/models", {
            "project": self.project, "name": self.name, "base_model": self.base_model,
            "lora": self.lora.model_dump(), "fall_back": fall_back})
        self.base_model = answer["base_model"]
        self.inference_base_url = f"{backend.base_url}/v1"
        self.inference_api_key = backend.api_key or "unused"
        self.inference_model_name = self.name
        self._attach(backend)

    def _run_config(self) -> dict[str, Any]:
        return {"base_model": self.base_model, "lora": self.lora.model_dump()}

    def _take_internal_config(self, backend: Backend) -> None:
        if not self._internal_config:
            return
        mapped = from_internal_config(self._internal_config)
        if mapped.lora:
            chosen = LoraConfig(**{**self.lora.model_dump(), **mapped.lora})
            if "lora" in self.model_fields_set and chosen != self.lora:
                raise ValueError(f"_internal_config asks for LoRA {mapped.lora}, but lora= says {self.lora}: "
                                 "set the adapter in one place")
            self.lora = chosen
        if mapped.settings:
            backend.take_engine_settings(mapped.settings, f"{self.name}'s _internal_config")

    @property
    def inference_name(self) -> str:
        return self.name

    def get_inference_name(self, step: int | None = None) -> str:
        return self.name if step is None else f"{self.name}@{step}"

    def openai_client(self, **kwargs: Any) -> AsyncOpenAI:
        """An `AsyncOpenAI` pointed at the backend; use `model=model.inference_name`."""
        return self.backend.openai_client(**kwargs)

    async def train(self, groups: list[TrajectoryGroup], config: TrainConfig | None = None,
                    _config: Mapping[str, Any] | None = None, *, metrics: Mapping[str, float] | None = None,
                    state: Mapping[str, Any] | None = None) -> TrainResult:
        """One GRPO step on `groups`; the new checkpoint is served before this returns. Groups that
        `gather_trajectory_groups` dropped are counted in the step's metrics, with their reasons.
        `_config`: ART's experimental settings (`art.dev.TrainConfig`), each applied or refused by name.
        `metrics`: numbers of your own recorded with the step; `state`: what your loop needs to
        resume after it (JSON), committed with the checkpoint and read back from `history()` as
        the step's `client_state` (PipelineTrainer keeps its place in the scenarios so)."""
        config = config or TrainConfig()
        if _config:
            config = train_config_with(config, _config)
        body = {"groups": [g.model_dump(mode="json") for g in groups],
                "config": config.model_dump(),
                "dropped": [d["reason"] for d in getattr(groups, "dropped", [])],
                "metrics": dict(metrics or {}), "state": None if state is None else dict(state)}
        result = TrainResult.model_validate(await self.backend.request("POST", self._path("train"), body))
        await self._report(result.step, "train", result.metrics)
        return result

    async def train_sft(self, trajectories: Iterable[Trajectory], config: TrainSFTConfig | None = None,
                        _config: Mapping[str, Any] | None = None, verbose: bool = False,
                        log_metrics: bool = True) -> TrainResult:
        """One SFT step on demonstrations (ART 0.5.23's `train_sft`): the token-mean cross-entropy of
        their assistant turns (`config.assistant_turns`: all, or each conversation's last), in
        batches of `config.batch_size`, one optimizer step each; the new checkpoint is served as
        `name@N` before this returns, and recorded in the history like a GRPO step. Captured
        trajectories train on their exact tokens; messages without token ids (a teacher's, a
        file's) are rendered with the served model's chat template and tool-call markup, as serving
        would have prompted and produced them. Nothing is trained if any trajectory is refused.
        `_config`: ART's `art.dev.TrainSFTConfig` (its `metric_logging` is taken; `log_metrics`
        says whether W&B gets the step's metrics). `verbose`: print a line on the step."""
        config = config or TrainSFTConfig()
        unknown = sorted(set(_config or {}) - {"metric_logging"})
        if unknown:
            raise ValueError(f"_config has {', '.join(map(repr, unknown))}: ART's dev.TrainSFTConfig settings here are "
                             "only `metric_logging`; pass the step's settings in TrainSFTConfig(...)")
        metric_logging = (_config or {}).get("metric_logging") or {}
        trajectories = list(trajectories)
        if not trajectories:
            raise ValueError("train_sft got no trajectories: pass at least one demonstration")
        strange = next((t for t in trajectories if not isinstance(t, Trajectory)), None)
        if strange is not None:
            hint = (": pass the trajectories of groups, [t for group in groups for t in group]"
                    if isinstance(strange, TrajectoryGroup) else "")
            raise TypeError(f"train_sft takes Trajectory objects, not {type(strange).__name__}{hint}")
        if verbose:
            print(f"train_sft: {len(trajectories)} trajectories, {config!r}")
        body = {"trajectories": [t.model_dump(mode="json") for t in trajectories], "config": config.model_dump()}
        result = TrainResult.model_validate(await self.backend.request("POST", self._path("train_sft"), body))
        if log_metrics and metric_logging.get("enabled", True):
            await self._report(result.step, "train", result.metrics)
        if verbose:
            print(f"train_sft: step {result.step}, loss {result.metrics.get('loss')}, "
                  f"{result.metrics.get('tokens/assistant')} trained tokens")
        return result

    async def delete_checkpoints(self, best_metric: str = "reward/mean", best_split: str = "val", *,
                                 best_checkpoint_metric: str | None = None) -> dict[str, Any]:
        """Delete all checkpoints except the latest and the best by `best_metric` in `best_split`.
        ART's `best_checkpoint_metric="val/reward"` names both at once (its `reward` is our `reward/mean`)."""
        if best_checkpoint_metric is not None:
            best_split, _, best_metric = best_checkpoint_metric.partition("/")
            if not best_metric:
                raise ValueError(f"best_checkpoint_metric={best_checkpoint_metric!r}: name it as split/metric, "
                                 "e.g. 'val/reward'")
            best_metric = "reward/mean" if best_metric == "reward" else best_metric
        return await self.backend.request("POST", self._path("delete_checkpoints"),
                                          {"best_metric": best_metric, "best_split": best_split})

    async def export(self, format: ExportFormat, out: str | os.PathLike[str], *, step: int | None = None,
                     quant: str | None = None, modelfile: bool = True) -> dict[str, Any]:
        """Write step `step` (default: the newest) to the folder `out` for serving elsewhere, as
        `art-backend export` does. `format`: "adapter" (peft's layout naming the base model's hub
        id: vLLM's --lora-modules, peft), "merged" (the base with the adapter merged in, safetensors
        with its tokenizer: transformers, vLLM) or "gguf" (llama.cpp's converter; `quant` "f16" by
        default, "q8_0", or a type llama-quantize makes such as "q4_k_m"; with an Ollama `Modelfile`
        unless `modelfile=False`). The backend writes it, on its own machine: `out` must be new or
        empty, and absolute unless the backend is a LocalBackend. Nothing is left at `out` when it
        fails. Returns what was written (`files`, name to bytes), the step, the base model."""
        path = Path(out)
        if not path.is_absolute():
            if not isinstance(self.backend, LocalBackend):
                raise ValueError(f"out={str(out)!r} is relative, but the backend at {self.backend.base_url} writes on "
                                 "its own machine: pass an absolute path there")
            path = path.absolute()
        return await self.backend.request("POST", self._path("export"), {
            "format": format, "out": str(path), "step": step, "quant": quant, "modelfile": modelfile})
