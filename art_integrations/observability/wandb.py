"""Weights & Biases: each training step's figures in a W&B run.

`TrainableModel(..., report_metrics=["wandb"])` (or, with `report_metrics` left at None, a set
WANDB_API_KEY or WANDB_MODE other than `disabled`) logs what `model.train()` and `model.log()`
return, the figures of history.jsonl, as `<split>/<metric>` against `training_step`. The run
lives in the W&B project of the model's project, named after the model, with a run id derived
from the name: a restarted job resumes the same run. `WANDB_MODE=offline` writes it locally.

A W&B failure never stops training: it is logged as a warning and kept in `errors`; after a
failed `wandb.init` the reporter stays off instead of retrying every step.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from art_integrations.observability._imports import require

logger = logging.getLogger(__name__)

STEP_METRIC = "training_step"
_RESERVED = re.compile(r"[:;,#?/'\s]")  # characters W&B refuses in a run id


def wandb_wanted(report_metrics: Sequence[str] | None) -> bool:
    """Explicit `report_metrics`, or else whether the environment configures W&B."""
    if report_metrics is not None:
        return "wandb" in report_metrics
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    return bool(os.environ.get("WANDB_API_KEY")) or (bool(mode) and mode != "disabled")


def run_id(project: str, name: str) -> str:
    """The model's name, made a valid run id (with a hash when characters had to be replaced)."""
    safe = _RESERVED.sub("-", name)
    if safe == name and len(name) <= 64:
        return name
    digest = hashlib.sha1(f"{project}/{name}".encode()).hexdigest()[:8]
    return f"{safe[:55]}-{digest}"


def numeric_metrics(split: str, metrics: Mapping[str, Any]) -> dict[str, float]:
    """`<split>/<name>` for the numbers and booleans; notes and lists of reasons are not plottable."""
    return {f"{split}/{name}": float(value) for name, value in metrics.items()
            if isinstance(value, (int, float)) and math.isfinite(value)}


class WandbReporter:
    """Logs a model's step metrics to one W&B run, started on the first `log`."""

    def __init__(self, project: str, name: str, config: Mapping[str, Any] | None = None) -> None:
        self._wandb = require("wandb", "wandb", "Logging metrics to W&B")
        self.project = project
        self.name = name
        self.run_id = run_id(project, name)
        self.config = dict(config or {})
        self.run: Any = None
        self.errors: list[str] = []
        self._off = False
        self._lock = threading.Lock()  # train and log may report from different threads

    def log(self, step: int, split: str, metrics: Mapping[str, Any]) -> None:
        """Log one history record; never raises."""
        with self._lock:
            run = self._started()
            if run is None:
                return
            try:
                run.log({STEP_METRIC: step, **numeric_metrics(split, metrics)})
            except Exception as error:  # whatever W&B raises, training goes on; the error is kept
                self._error(f"logging {split} metrics of step {step} to W&B failed: {error!r}")

    def _started(self) -> Any:
        if self.run is not None or self._off:
            return self.run
        try:
            # "allow": resume the run with this id if it exists; "create_new": several models of
            # one process keep separate runs instead of finishing each other's
            run = self._wandb.init(project=self.project, name=self.name, id=self.run_id, resume="allow",
                                   config=self.config, reinit="create_new")
        except Exception as error:  # no key, a bad setting, no network: said once, then off
            self._off = True
            self._error(f"W&B logging is off for {self.project}/{self.name}: wandb.init failed: {error!r}")
            return None
        try:
            # steps of history.jsonl, not W&B's own counter: a val record logged at the step a train
            # record ended on, or after a restart, would otherwise be refused as out of order
            run.define_metric(STEP_METRIC)
            run.define_metric("*", step_metric=STEP_METRIC)
        except Exception as error:  # still worth logging, against W&B's own step
            self._error(f"W&B run {self.run_id}: plotting against {STEP_METRIC} failed: {error!r}")
        self.run = run
        return run

    def _error(self, message: str) -> None:
        logger.warning(message)
        self.errors.append(message)

    def finish(self) -> None:
        """End the run (W&B also ends it when the process exits)."""
        with self._lock:
            if self.run is not None:
                try:
                    self.run.finish()
                except Exception as error:  # the run's data is already written; say so, go on
                    self._error(f"finishing the W&B run failed: {error!r}")
                self.run = None


def reporter_for(project: str, name: str, report_metrics: Sequence[str] | None,
                 config: dict[str, Any]) -> WandbReporter | None:
    """The reporter a model's `report_metrics` asks for (its run's `config`), or None. Asked for
    explicitly and not installed: ImportError. Switched on by the environment and not installed: a warning."""
    if not wandb_wanted(report_metrics):
        return None
    try:
        return WandbReporter(project, name, config)
    except ImportError as error:
        if report_metrics is not None:
            raise
        logger.warning("WANDB_API_KEY or WANDB_MODE is set, but metrics are not logged to W&B: %s", error)
        return None
