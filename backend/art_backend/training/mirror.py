"""A backend on a node that may vanish (a Ray actor on an autoscaled GPU node) keeps its models in
an object store: every committed step and every logged score is pushed there before the request
is answered, so what a client was told is done outlives the node; and a model registering first
pulls what the art dir lacks, so a backend started again on a fresh node resumes at the newest
step the store holds. The copying itself, and why a half-finished push never looks complete, is
sync.py's."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from art_backend.errors import StorageError
from art_backend.training import sync
from art_backend.training.checkpoints import ModelFiles

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreMirror:
    url: str  # any fsspec URL: s3://bucket/prefix, gs://..., file:///shared/path
    options: dict[str, Any] = field(default_factory=dict)  # fsspec storage options

    def __post_init__(self) -> None:
        sync.Store(self.url, "-", "-", self.options)  # a URL or options fsspec cannot open: refused at the start

    async def restore(self, model: ModelFiles) -> None:
        """Pull the model's steps, history and trajectories the art dir lacks (nothing, for a new model)."""
        def pulled() -> dict[str, Any]:
            if sync.Store(self.url, model.project, model.name, self.options).manifest() is None:
                return {"pulled": []}  # a model new to the store: nothing to say (a pull by hand warns)
            return sync.pull(model, self.url, self.options, None, set())

        result = await asyncio.to_thread(pulled)
        if result["pulled"]:
            logger.info("%s/%s: steps %s pulled from the checkpoint store %s", model.project, model.name,
                        result["pulled"], result["url"])

    async def save(self, model: ModelFiles, what: str, delete: bool = False) -> None:
        """Push what the store lacks; `what` (e.g. "Step 3") names what the caller would lose."""
        try:
            await asyncio.to_thread(sync.push, model, self.url, self.options, delete)
        except StorageError as error:
            raise StorageError(f"{what} of {model.project}/{model.name} is committed on this node but not in the "
                               f"checkpoint store, so it would not outlive the node: {error} The next push (each "
                               "step's, or POST .../push) copies it once the store answers.") from error
