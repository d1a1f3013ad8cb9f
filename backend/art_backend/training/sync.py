"""A model's checkpoints, history and trajectories copied to and from object storage: any fsspec
URL (s3:// through s3fs, gs://, file://, ...), so a run outlives the machine it trained on.

In the store a model sits as in the art dir, `<url>/<project>/models/<name>/`, beside one more
file, `manifest.json`: every file the store holds for the model, with its size and sha256. A push
uploads the files first and the manifest last, and a pull reads only what a manifest lists, each
file checked against it: a push interrupted part way leaves the previous manifest, so a partial
upload never looks complete. Checkpoints never change once committed, so a push uploads only the
steps the manifest lacks; history and trajectory files only grow, so a pull reads the length the
manifest recorded. Pulled steps arrive whole (staged, fsynced, renamed into place, as a train step
is committed), and a pull run again after an interruption finishes what the first one started.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import fsspec
from fsspec.implementations.local import LocalFileSystem

from art_backend.durable import append_lines, fsync_directory, fsync_tree, write_atomically
from art_backend.errors import StorageError, SyncRefused
from art_backend.kill_points import kill_point
from art_backend.training.checkpoints import STEP_RECORD, ModelFiles

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
Part = Literal["checkpoints", "history", "trajectories"]


@dataclass
class Entry:
    size: int
    sha256: str


@dataclass
class Manifest:
    project: str
    name: str
    steps: list[int] = field(default_factory=list)
    files: dict[str, Entry] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "project": self.project, "name": self.name, "steps": self.steps,
                           "files": {path: vars(entry) for path, entry in sorted(self.files.items())}}, indent=1)


def _digest(path: Path, size: int | None = None) -> Entry:
    """Size and sha256 of `path` (of its first `size` bytes when given)."""
    digest, left = hashlib.sha256(), size if size is not None else path.stat().st_size
    with open(path, "rb") as handle:
        while left > 0 and (chunk := handle.read(min(left, 1 << 20))):
            digest.update(chunk)
            left -= len(chunk)
    return Entry(size=size if size is not None else path.stat().st_size, sha256=digest.hexdigest())


class Store:
    """One model's folder in the store, with errors that say where they happened."""

    def __init__(self, url: str, project: str, name: str, options: dict[str, Any]) -> None:
        self.url = url
        if not re.match(r"[a-z][a-z0-9+.-]*://", url):  # a bare path would land relative to the backend's cwd
            raise SyncRefused(f"{url[:200]!r} is not a storage URL: name the store as s3://bucket/prefix, "
                              "file:///absolute/path, or another fsspec URL.")
        try:  # a fresh instance each time: a cached one would keep the credentials and endpoint it began with
            self.fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, **options)
        except ImportError as error:
            raise SyncRefused(f"{url[:200]!r} needs a package the backend's machine lacks ({error}); for s3:// "
                              "`pip install 'art-backend[s3]'` there.") from error
        except (ValueError, TypeError) as error:
            raise SyncRefused(f"{url[:200]!r} with storage_options {sorted(options)} is not a store fsspec opens: "
                              f"{error}") from error
        if isinstance(self.fs, LocalFileSystem) and not url.startswith("file:///"):
            raise SyncRefused(f"{url[:200]!r}: a file:// URL names an absolute path (file:///path/to/store).")
        self.root = f"{root.rstrip('/')}/{project}/models/{name}"
        self._folders: set[str] = set()  # made already (on S3, making one asks whether the bucket exists)

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def call(self, what: str, action: Any, *args: Any) -> Any:
        try:
            return action(*args)
        except Exception as error:  # noqa: BLE001 - every way a store fails (botocore's own included) is named
            raise StorageError(f"{what} at {self.url!r} failed: {type(error).__name__}: {error}. Check the URL, the "
                               "credentials the backend's machine has for it (for s3:// the AWS_* variables or its "
                               "role), and the bucket.") from error

    def manifest(self) -> Manifest | None:
        if not self.call("Looking for the manifest", self.fs.exists, self.path(MANIFEST)):
            return None
        raw = self.call("Reading the manifest", self.fs.cat_file, self.path(MANIFEST))
        try:
            described = json.loads(raw)
            if described.get("format") != FORMAT:
                raise ValueError(f"it is of format {described.get('format')!r}; this backend reads {FORMAT}")
            return Manifest(described["project"], described["name"], sorted(described["steps"]),
                            {path: Entry(**entry) for path, entry in described["files"].items()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise StorageError(f"{self.path(MANIFEST)} does not read as a manifest ({error!r}): remove it from "
                               "the store, and a push then uploads everything again.") from error

    def put(self, local: Path, relative: str) -> None:
        target = self.path(relative)
        folder = target.rsplit("/", 1)[0]
        if folder not in self._folders:
            self.call(f"Uploading {relative}", self.fs.makedirs, folder, True)
            self._folders.add(folder)
        self.call(f"Uploading {relative}", self.fs.put_file, str(local), target)

    def get(self, relative: str, entry: Entry, local: Path) -> None:
        """Download the bytes the manifest recorded for `relative` into `local`, checked against it."""
        with self.call(f"Opening {relative}", self.fs.open, self.path(relative), "rb") as source, \
                open(local, "wb") as target:
            left = entry.size
            while left > 0:
                chunk = self.call(f"Downloading {relative}", source.read, min(left, 8 << 20))
                if not chunk:
                    break
                target.write(chunk)
                left -= len(chunk)
        if _digest(local, entry.size) != entry or local.stat().st_size != entry.size:
            local.unlink()
            raise StorageError(f"{self.path(relative)} does not match the manifest (a push under way, or a file "
                               "changed in the store by hand): pull again once the push is done, or push again.")

    def write_manifest(self, manifest: Manifest) -> None:
        """Last, and whole: written beside, then moved over the old one."""
        staged = self.path(f".{MANIFEST}.uploading")
        self.call("Writing the manifest", self.fs.pipe_file, staged, manifest.to_json().encode())
        self.call("Writing the manifest", self.fs.mv, staged, self.path(MANIFEST))


# ----- push --------------------------------------------------------------------------------------

def _model_files(model: ModelFiles) -> dict[str, Path]:
    """What a push copies: the description, the history, each committed step, the trajectories."""
    files = {name: model.directory / name for name in ("model.json", "history.jsonl")
             if (model.directory / name).is_file()}
    for step in model.steps():
        folder = model.checkpoints / f"{step:04d}"
        files.update({f"checkpoints/{step:04d}/{p.name}": p for p in folder.iterdir() if p.is_file()})
    trajectories = model.directory / "trajectories"
    if trajectories.is_dir():
        files.update({p.relative_to(model.directory).as_posix(): p for p in trajectories.glob("*/*.jsonl")
                      if not p.name.startswith(".")})
    return files


def push(model: ModelFiles, url: str, options: dict[str, Any], delete: bool) -> dict[str, Any]:
    """Copy what the store lacks, then the manifest; `delete`: also remove from the store the steps
    and files the art dir no longer has (after the manifest stops listing them)."""
    store = Store(url, model.project, model.name, options)
    previous = store.manifest() or Manifest(model.project, model.name)
    local = _model_files(model)
    steps = model.steps()
    manifest = Manifest(model.project, model.name, sorted(set(steps) | (set() if delete else set(previous.steps))))
    if not delete:
        manifest.files = {path: entry for path, entry in previous.files.items() if path not in local}
    uploaded: list[str] = []
    for relative, path in sorted(local.items()):
        entry = previous.files.get(relative)
        if relative.startswith("checkpoints/") and entry is not None and _same_step(model, previous, relative):
            manifest.files[relative] = entry  # committed checkpoints never change: no need to read them again
            continue
        digest = _digest(path)
        if digest != entry:
            store.put(path, relative)
            uploaded.append(relative)
        manifest.files[relative] = digest
    kill_point("push_files_uploaded")
    store.write_manifest(manifest)
    removed = sorted(set(previous.files) - set(manifest.files))
    if removed:
        store.call("Removing what the art dir no longer has", store.fs.rm, [store.path(p) for p in removed])
    return {"url": f"{url.rstrip('/')}/{model.project}/models/{model.name}", "steps": manifest.steps,
            "uploaded": uploaded, "removed": removed}


def _same_step(model: ModelFiles, previous: Manifest, relative: str) -> bool:
    """Whether the store's copy of this file's step is the local step (its record, with the step's
    time, matches), not an older run's step of the same number."""
    record = "/".join(relative.split("/")[:2]) + f"/{STEP_RECORD}"
    local = model.directory / record
    return record in previous.files and local.is_file() and _digest(local) == previous.files[record]


# ----- pull --------------------------------------------------------------------------------------

def pull(model: ModelFiles, url: str, options: dict[str, Any], step: int | Literal["latest"] | None,
         exclude: set[Part]) -> dict[str, Any]:
    """Bring into the art dir what the store's manifest lists and the art dir lacks: steps (all, one,
    or the newest), history records, trajectory files. What is here already stays as it is."""
    store = Store(url, model.project, model.name, options)
    manifest = store.manifest()
    if manifest is None:
        logger.warning("%s/%s: nothing to pull from %s (no %s there)", model.project, model.name, store.root, MANIFEST)
        return {"url": store.root, "steps": [], "pulled": [], "note": f"nothing at {store.root}: no model was pushed "
                "there (a push writes its manifest.json last)"}
    wanted = _wanted_steps(manifest, step, store.root)
    _pull_description(model, store, manifest)
    pulled = []
    if "checkpoints" not in exclude:
        have = set(model.steps())
        for number in wanted:
            if number not in have:
                _pull_step(model, store, manifest, number)
                pulled.append(number)
    records = 0
    if "history" not in exclude and "history.jsonl" in manifest.files:
        records = _merge_history(model, store, manifest.files["history.jsonl"])
    trajectories = []
    if "trajectories" not in exclude:
        for relative, entry in sorted(manifest.files.items()):
            target = model.directory / relative
            if relative.startswith("trajectories/") and not target.exists():
                _fetch_whole(store, relative, entry, target)
                trajectories.append(relative)
    return {"url": store.root, "steps": manifest.steps, "pulled": pulled, "history_records": records,
            "trajectories": trajectories}


def _wanted_steps(manifest: Manifest, step: int | Literal["latest"] | None, where: str) -> list[int]:
    if step is None:
        return manifest.steps
    if step == "latest":
        return manifest.steps[-1:]
    if step not in manifest.steps:
        raise SyncRefused(f"Step {step} is not in the store at {where} (it holds steps {manifest.steps}).")
    return [step]


def _pull_description(model: ModelFiles, store: Store, manifest: Manifest) -> None:
    """model.json first: it names the LoRA shape the pulled checkpoints were trained with."""
    if "model.json" not in manifest.files:
        return
    local = model.directory / "model.json"
    staged = model.directory / ".model.json.pulling"
    model.directory.mkdir(parents=True, exist_ok=True)
    store.get("model.json", manifest.files["model.json"], staged)
    theirs = json.loads(staged.read_text())
    staged.unlink()
    if local.is_file():
        ours = json.loads(local.read_text())
        if ours.get("lora") == theirs.get("lora") or theirs.get("trainable") is False:
            return
        if model.steps():
            raise SyncRefused(f"{model.project}/{model.name} here has checkpoints with LoRA {ours.get('lora')}, the "
                              f"store's with {theirs.get('lora')}: they are different models. Pull into another art "
                              "dir, or under another name.")
    write_atomically(local, json.dumps({**theirs, "project": model.project, "name": model.name}, indent=2))


def _pull_step(model: ModelFiles, store: Store, manifest: Manifest, step: int) -> None:
    """A step arrives as a train step is committed: staged, fsynced, renamed into place (a crash
    leaves a staging folder that the next registration rolls back)."""
    prefix = f"checkpoints/{step:04d}/"
    staging = model.new_staging()
    try:
        for relative, entry in manifest.files.items():
            if relative.startswith(prefix):
                store.get(relative, entry, staging / relative[len(prefix):])
        fsync_tree(staging)
        os.replace(staging, model.checkpoints / f"{step:04d}")
        fsync_directory(model.checkpoints)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed into place


def _merge_history(model: ModelFiles, store: Store, entry: Entry) -> int:
    """Append the store's records that the local history lacks (a record is its whole content)."""
    staged = model.directory / ".history.jsonl.pulling"
    store.get("history.jsonl", entry, staged)
    try:
        theirs = [line for line in staged.read_text().splitlines() if line.strip()]
    finally:
        staged.unlink()
    ours = {json.dumps(record, sort_keys=True) for record in model.history()}
    missing = []
    for line in theirs:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            logger.warning("%s/%s: skipping a pulled history line that is not JSON: %.80r", model.project,
                           model.name, line)
            continue
        if json.dumps(record, sort_keys=True) not in ours:
            missing.append(json.dumps(record))
    if missing:
        append_lines(model.history_path, missing)
    return len(missing)


def _fetch_whole(store: Store, relative: str, entry: Entry, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.pulling")
    store.get(relative, entry, staged)
    with open(staged, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(staged, target)
    fsync_directory(target.parent)
