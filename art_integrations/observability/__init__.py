"""Observability: trajectories as Langfuse traces, step metrics in Weights & Biases.

Neither SDK is imported until used; each is an extra: `pip install "art-integrations[langfuse]"`,
`pip install "art-integrations[wandb]"`.
"""

from art_integrations.observability.langfuse import ExportReport, LangfuseExporter, StepExport
from art_integrations.observability.langfuse_tree import TraceLabels
from art_integrations.observability.wandb import WandbReporter

__all__ = ["ExportReport", "LangfuseExporter", "StepExport", "TraceLabels", "WandbReporter"]
