"""Langfuse export: every trajectory becomes a Langfuse trace.

    exporter = LangfuseExporter()                      # LANGFUSE_PUBLIC_KEY / _SECRET_KEY / _BASE_URL
    groups = await gather_trajectory_groups(specs, langfuse=exporter.for_step(model, step))   # live
    python -m art_integrations.observability.langfuse --art-dir .art --project P --model M  # afterwards

The trace of one trajectory:

    rollout (agent)                  input: the task, output: the last message
      model call (generation)        messages in and out, tool calls, model `name@step`, token usage
      get_weather (tool)             a tool call's arguments and the tool's answer
      model call (generation)
      researcher (agent)             a sub-agent (an additional history), or `branch` (chain)
        model call (generation) ...

Scores: `reward` and every metric (RULER's `ruler_score` and `independent_reward` among them,
with the judge's explanation as the comment). Trace metadata and tags: project, model, step,
split, scenario, so one step's group can be filtered. `step` is the policy's step, the
checkpoint that produced the rollouts (`name@step`).

The SDK uploads from background threads; what it fails to upload it logs as errors. Those are
counted (`flush()` reports them); an export never raises into the training loop.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from art_integrations.observability._imports import require
from art_integrations.observability.langfuse_tree import (
    add_history,
    add_sub_history,
    closing,
    opening,
    TraceLabels,
    trace_attributes,
)
from art_integrations.observability.stored import StoredFile, read_groups, stored_files
from art_integrations.trajectory import MetricValue, Trajectory, TrajectoryGroup

if TYPE_CHECKING:
    from langfuse import Langfuse

    from art_integrations.model import TrainableModel

logger = logging.getLogger(__name__)

REQUIRED_ENV = ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY")
TRACE_ID_KEY = "langfuse_trace_id"  # trajectory.metadata: the trace a live export created
# Loggers the SDK's upload threads report failures on (records logged directly on them).
_SDK_LOGGERS = ("langfuse", "opentelemetry.exporter.otlp.proto.http.trace_exporter")


@dataclass(frozen=True)
class ExportReport:
    traces: int
    scores: int
    failures: int  # trajectories whose trace could not be built
    upload_errors: int  # errors the SDK logged while uploading

    @property
    def ok(self) -> bool:
        return not (self.failures or self.upload_errors)

    def since(self, earlier: ExportReport) -> ExportReport:
        return ExportReport(self.traces - earlier.traces, self.scores - earlier.scores,
                            self.failures - earlier.failures, self.upload_errors - earlier.upload_errors)

    def __str__(self) -> str:
        return (f"{self.traces} traces and {self.scores} scores exported to Langfuse; {self.failures} failed, "
                f"{self.upload_errors} upload errors")


class _SdkErrorCounter(logging.Filter):
    """Counts the ERROR records of the SDK (its upload threads report failures only so; any
    Langfuse use in the process counts). A filter, not a handler: adding a handler would stop
    Python printing those records when logging is not configured."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.last = ""
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            with self._lock:
                self.count += 1
                self.last = record.getMessage()
        return True

    def attach(self) -> None:
        for name in _SDK_LOGGERS:
            logging.getLogger(name).addFilter(self)

    def detach(self) -> None:
        for name in _SDK_LOGGERS:
            logging.getLogger(name).removeFilter(self)


class LangfuseExporter:
    """Sends trajectories to Langfuse as traces. `client`: a `langfuse.Langfuse`; by default one
    configured from the environment (LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and
    LANGFUSE_BASE_URL or LANGFUSE_HOST), shared with Langfuse's own LangChain handler."""

    def __init__(self, client: Langfuse | None = None) -> None:
        sdk = require("langfuse", "langfuse", "Langfuse export")
        if not hasattr(sdk, "propagate_attributes"):
            raise ImportError("Langfuse export needs a newer langfuse SDK (one with `langfuse.propagate_attributes`): "
                              'pip install -U "art-integrations[langfuse]"')
        if client is None:
            missing = [name for name in REQUIRED_ENV if not os.environ.get(name)]
            if missing:
                raise ValueError(f"Langfuse export is not configured: set {' and '.join(missing)} (and "
                                 "LANGFUSE_BASE_URL for a self-hosted server), or pass client=langfuse.Langfuse(...).")
            client = sdk.Langfuse()
        if os.environ.get("LANGFUSE_TRACING_ENABLED", "true").lower() == "false":
            logger.warning("LANGFUSE_TRACING_ENABLED=false: the Langfuse SDK will send no traces or scores")
        self.client = client
        self._propagate = sdk.propagate_attributes
        self.traces = 0
        self.scores = 0
        self.failures: list[str] = []
        self._sdk_errors = _SdkErrorCounter()
        self._sdk_errors.attach()
        self._upload_errors_seen = 0

    # ----- exporting ------------------------------------------------------------------------

    def for_step(self, model: TrainableModel | str, step: int, split: str = "train",
                 project: str | None = None) -> StepExport:
        """What `gather_trajectory_groups(..., langfuse=...)` takes: this exporter with the labels
        of one step. `model`: a TrainableModel, or a model name together with `project`."""
        if isinstance(model, str):
            if project is None:
                raise ValueError("for_step(model_name, ...) needs project=")
            return StepExport(self, TraceLabels(project, model, step, split))
        return StepExport(self, TraceLabels(project or model.project, model.name, step, split))

    def export_group(self, group: TrajectoryGroup, labels: TraceLabels, group_index: int = 0) -> list[str]:
        """One trace per trajectory of `group`; returns the trace ids of those exported."""
        traces = [self.export_trajectory(t, labels, group_index=group_index, index=i, group_metadata=group.metadata)
                  for i, t in enumerate(group.trajectories)]
        return [trace for trace in traces if trace is not None]

    def export_trajectory(self, trajectory: Trajectory, labels: TraceLabels, *, group_index: int = 0, index: int = 0,
                          group_metadata: dict[str, Any] | None = None) -> str | None:
        """Send one trajectory as a trace; its id is kept in `trajectory.metadata["langfuse_trace_id"]`.
        A failure is logged, counted in `failures` and noted in the trajectory's metadata; never raised."""
        try:
            trace_id = self._trace(trajectory, labels, group_index, index, group_metadata or {})
        except Exception as error:  # an export must not stop training: report it where it is seen
            message = (f"exporting trajectory {index} of group {group_index} ({labels.split}, step {labels.step}) "
                       f"to Langfuse failed: {error!r}")
            logger.warning(message, exc_info=True)
            self.failures.append(message)
            trajectory.metadata["langfuse_error"] = repr(error)
            return None
        trajectory.metadata[TRACE_ID_KEY] = trace_id
        self.traces += 1
        return trace_id

    def _trace(self, trajectory: Trajectory, labels: TraceLabels, group_index: int, index: int,
               group_metadata: dict[str, Any]) -> str:
        trace_id = self.client.create_trace_id()
        scenario = trajectory.metadata.get("scenario", group_metadata.get("scenario"))
        tags, metadata = trace_attributes(labels, scenario, group_index, index)
        root_metadata = {**trajectory.metadata, "metrics": trajectory.metrics, "logs": trajectory.logs,
                         "group_metadata": group_metadata}
        with self.client.start_as_current_observation(
                trace_context={"trace_id": trace_id}, name="rollout", as_type="agent",
                input=opening(trajectory), metadata=root_metadata) as root:
            # trace name, tags and metadata go on the root and every observation under it
            with self._propagate(trace_name=labels.model, tags=tags, metadata=metadata):
                add_history(root, trajectory, labels)
                agents = trajectory.metadata.get("additional_history_agents") or []
                for number, history in enumerate(trajectory.additional_histories):
                    add_sub_history(root, history, labels, agents[number] if number < len(agents) else None, number)
            root.update(output=closing(trajectory))
        self._score(trace_id, trajectory)
        return trace_id

    def _score(self, trace_id: str, trajectory: Trajectory) -> None:
        explanation = trajectory.metadata.get("ruler_explanation") or None
        scores: list[tuple[str, MetricValue]] = [("reward", trajectory.reward), *trajectory.metrics.items()]
        for name, value in scores:
            self.client.create_score(
                trace_id=trace_id, name=name, value=float(value),
                data_type="BOOLEAN" if isinstance(value, bool) else "NUMERIC",
                comment=explanation if name in ("reward", "ruler_score") else None)
            self.scores += 1

    # ----- delivery -------------------------------------------------------------------------

    def flush(self) -> ExportReport:
        """Wait until the SDK has sent everything queued (blocking: call it from a thread in async
        code), warn about upload errors it logged since the last flush, and report the totals."""
        try:
            self.client.flush()
        except Exception as error:
            logger.warning("flushing Langfuse failed: %r", error, exc_info=True)
            self.failures.append(f"flush failed: {error!r}")
        new_errors = self._sdk_errors.count - self._upload_errors_seen
        if new_errors:
            self._upload_errors_seen = self._sdk_errors.count
            logger.warning("Langfuse: the SDK logged %d upload errors (last: %s); some traces or scores may be "
                           "missing in Langfuse", new_errors, self._sdk_errors.last)
        return self.report()

    def report(self) -> ExportReport:
        return ExportReport(self.traces, self.scores, len(self.failures), self._sdk_errors.count)

    def close(self) -> ExportReport:
        """Flush and stop counting the SDK's errors (the Langfuse client itself stays usable)."""
        report = self.flush()
        self._sdk_errors.detach()
        return report

    def __enter__(self) -> LangfuseExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepExport:
    """A `LangfuseExporter` with the labels of one step, for `gather_trajectory_groups(langfuse=...)`;
    `flush()` reports what was exported since it was made (the exporter's totals span all steps)."""

    def __init__(self, exporter: LangfuseExporter, labels: TraceLabels) -> None:
        self.exporter = exporter
        self.labels = labels
        self._start = exporter.report()

    def export_group(self, group: TrajectoryGroup, group_index: int) -> None:
        self.exporter.export_group(group, self.labels, group_index)

    def flush(self) -> ExportReport:
        return self.exporter.flush().since(self._start)


# ----- exporting stored trajectories afterwards -----------------------------------------------


def _trajectories(files: Sequence[StoredFile]) -> Iterator[tuple[StoredFile, int, TrajectoryGroup]]:
    for stored in files:
        for group_index, group in enumerate(read_groups(stored.path)):
            yield stored, group_index, group


def export_stored(exporter: LangfuseExporter, art_dir: Path, project: str, model: str, *, step: int | None = None,
                  split: str | None = None, again: bool = False,
                  progress: bool = True) -> tuple[ExportReport, int, int]:
    """Export what the backend stored for a model; returns (report, files, skipped). Trajectories
    already exported live (they carry `langfuse_trace_id`) are skipped unless `again`."""
    files = [f for f in stored_files(art_dir, project, model, split) if step is None or f.policy_step == step]
    groups = list(_trajectories(files))
    total = sum(len(group.trajectories) for _, _, group in groups)
    skipped = 0
    with tqdm(total=total, desc="langfuse export", unit="trajectory", disable=not progress) as bar:
        for stored, group_index, group in groups:
            labels = TraceLabels(project, model, stored.policy_step, stored.split)
            for index, trajectory in enumerate(group.trajectories):
                if TRACE_ID_KEY in trajectory.metadata and not again:
                    skipped += 1
                else:
                    exporter.export_trajectory(trajectory, labels, group_index=group_index, index=index,
                                               group_metadata=group.metadata)
                bar.update(1)
    return exporter.flush(), len(files), skipped


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m art_integrations.observability.langfuse",
        description="Send a model's stored trajectories to Langfuse, one trace per trajectory (configured by "
                    "LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and LANGFUSE_BASE_URL).")
    parser.add_argument("--art-dir", type=Path, default=Path(".art"), help="the backend's --art-dir (default .art)")
    parser.add_argument("--project", required=True)
    parser.add_argument("--model", required=True, help="the model's name")
    parser.add_argument("--step", type=int, help="only the rollouts of this policy step (default: all)")
    parser.add_argument("--split", help="only this split, e.g. train or val (default: all)")
    parser.add_argument("--again", action="store_true", help="also trajectories already exported live")
    args = parser.parse_args(argv)
    try:
        exporter = LangfuseExporter()
        report, files, skipped = export_stored(exporter, args.art_dir, args.project, args.model, step=args.step,
                                               split=args.split, again=args.again)
    except (ImportError, ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    exporter.close()
    print(f"langfuse: {files} files of {args.project}/{args.model}: {report}"
          + (f"; {skipped} skipped, exported live before (--again sends them again)" if skipped else ""))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
