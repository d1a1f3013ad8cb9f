"""Checkpoint sync to object storage, as backend methods: ours (`push_checkpoints`,
`pull_checkpoints`) and ART's (`_experimental_push_to_s3`, `_experimental_pull_from_s3`, with its
arguments and meanings).

The backend does the copy, local or remote alike: the art dir lives with it, so the storage URL's
credentials are the backend machine's (for s3:// its AWS_* variables or its role), and a push
waits for any train step in progress, never copying half of one. The layout in the store and why a
partial push never looks complete: `art_backend/training/sync.py`.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Protocol



class StoredModel(Protocol):
    """A model as the art dir keeps its files, under `project/name`: a `Model` or a `TrainableModel`."""

    project: str
    name: str


Part = Literal["checkpoints", "history", "trajectories"]
# ART's parts: its "logs" folder (the engine's log files) is not kept in the art dir here
_ART_EXCLUDABLE: dict[str, Part | None] = {"checkpoints": "checkpoints", "trajectories": "trajectories", "logs": None}


def s3_url(s3_bucket: str | None, prefix: str | None) -> str:
    """ART's store location: s3://<bucket>/<prefix>, the bucket from BACKUP_BUCKET when not named."""
    bucket = s3_bucket or os.environ.get("BACKUP_BUCKET")
    if not bucket:
        raise ValueError("No bucket: pass s3_bucket=... or set BACKUP_BUCKET (as in ART).")
    return f"s3://{bucket}/{prefix.strip('/')}" if prefix and prefix.strip("/") else f"s3://{bucket}"


class CheckpointSync:
    """Mixed into `Backend`: what it needs is `request`."""

    async def request(self, method: str, path: str, json: Any = None) -> Any:
        raise NotImplementedError

    async def push_checkpoints(self, model: StoredModel, url: str, *, delete: bool = False,
                               storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Copy `model`'s checkpoints, history and trajectories to `<url>/<project>/models/<name>/`
        (`url`: any fsspec URL the backend can reach: s3://bucket/prefix, file:///path, ...).
        Only what the store lacks is uploaded. `delete=True` also removes from the store the steps
        the art dir no longer has. Returns what was uploaded and the steps the store now holds."""
        return await self.request("POST", f"/v1/training/models/{model.project}/{model.name}/push",
                                  {"url": url, "delete": delete, "storage_options": storage_options or {}})

    async def pull_checkpoints(self, model: StoredModel, url: str, *, step: int | Literal["latest"] | None = None,
                               exclude: list[Part] | None = None,
                               storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """Bring `model`'s files from `<url>/<project>/models/<name>/` into the backend's art dir:
        every complete step the store holds (or `step`, or only the newest with "latest"), the
        history records and trajectory files it lacks. Called before `model.register(backend)`,
        the model then resumes from the newest pulled step; after it, pulled steps are served at
        once. Steps already here are kept as they are."""
        return await self.request("POST", f"/v1/training/models/{model.project}/{model.name}/pull",
                                  {"url": url, "step": step, "exclude": exclude or [],
                                   "storage_options": storage_options or {}})

    # ----- ART's names ------------------------------------------------------------------------

    async def _experimental_push_to_s3(self, model: StoredModel, *, s3_bucket: str | None = None,
                                       prefix: str | None = None, verbose: bool = False,
                                       delete: bool = False) -> None:
        """ART's: push to s3://<s3_bucket or BACKUP_BUCKET>/<prefix>/<project>/models/<name>."""
        result = await self.push_checkpoints(model, s3_url(s3_bucket, prefix), delete=delete)
        if verbose:
            print(f"pushed {len(result['uploaded'])} files to {result['url']} (steps {result['steps']})")

    async def _experimental_pull_from_s3(self, model: StoredModel, *, s3_bucket: str | None = None,
                                         prefix: str | None = None, verbose: bool = False, delete: bool = False,
                                         only_step: int | Literal["latest"] | None = None, step: int | None = None,
                                         exclude: list[str] | None = None, latest_only: bool = False) -> None:
        """ART's: pull from s3://<s3_bucket or BACKUP_BUCKET>/<prefix>/<project>/models/<name>;
        `only_step` (or its older names `step`, `latest_only=True`) picks one step, `exclude` leaves
        "checkpoints" or "trajectories" in the store."""
        if delete:
            raise ValueError("_experimental_pull_from_s3(delete=True): a pull never deletes local steps here. Delete "
                             "them with model.delete_checkpoints(), or pull into an empty art dir.")
        unknown = sorted(set(exclude or []) - set(_ART_EXCLUDABLE))
        if unknown:
            raise ValueError(f"exclude={unknown}: the parts are {sorted(_ART_EXCLUDABLE)}")
        chosen = step if step is not None else only_step if only_step is not None else \
            "latest" if latest_only else None
        parts = [part for part in (_ART_EXCLUDABLE[name] for name in exclude or []) if part is not None]
        result = await self.pull_checkpoints(model, s3_url(s3_bucket, prefix), step=chosen, exclude=parts)
        if verbose:
            print(f"pulled steps {result['pulled']} from {result['url']}" + (f" ({result['note']})"
                                                                             if "note" in result else ""))
