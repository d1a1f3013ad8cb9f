"""A model hub on disk and on loopback, for tests that must not reach the network.

`write_hub_cache` lays a model out as huggingface_hub's cache does (`models--org--name/` with
`refs/<branch>` naming a commit, `snapshots/<commit>/<file>` linking into `blobs/`), so
HF_HUB_CACHE plus HF_HUB_OFFLINE=1 serves it. `fake_hub_app` answers the routes that
huggingface_hub's `snapshot_download` requests (model info, file tree, file downloads) and the
hub's errors (X-Error-Code headers), so HF_ENDPOINT pointed at it downloads for real.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse


def model_files(model_dir: Path) -> dict[str, bytes]:
    """The files of a model directory, by path relative to it."""
    return {str(p.relative_to(model_dir)): p.read_bytes() for p in sorted(model_dir.rglob("*")) if p.is_file()}


def commit_id(label: str) -> str:
    """A 40-hex commit id, as the hub names revisions."""
    return hashlib.sha1(label.encode()).hexdigest()


def write_hub_cache(cache: Path, repo_id: str, snapshots: dict[str, dict[str, bytes]], refs: dict[str, str]) -> Path:
    """Lay out `repo_id` in the hub cache `cache`: each snapshot (commit -> files) with its files
    linked to content-addressed blobs, each ref (branch -> commit) as a file. Returns the repo folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, files in snapshots.items():
        for name, content in files.items():
            blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
            if not blob.exists():
                blob.write_bytes(content)
            pointer = repo / "snapshots" / commit / name
            pointer.parent.mkdir(parents=True, exist_ok=True)
            pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (repo / "refs").mkdir(exist_ok=True)
    for branch, commit in refs.items():
        (repo / "refs" / branch).write_text(commit)
    return repo


@dataclass
class HubRepo:
    files: dict[str, bytes]
    commit: str
    gated: bool = False


@dataclass
class FakeHub:
    repos: dict[str, HubRepo]
    downloaded: list[str] = field(default_factory=list)  # "<repo>/<file>" of each file sent


def _error(status: int, code: str, message: str) -> Response:
    return Response(status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message})


def fake_hub_app(hub: FakeHub) -> FastAPI:
    app = FastAPI()

    def find(repo_id: str, revision: str) -> HubRepo | Response:
        repo = hub.repos.get(repo_id)
        if repo is None:  # the hub answers 401 for a repo it will not name, existing or not
            return _error(401, "RepoNotFound", "Repository not found")
        if repo.gated:
            return _error(403, "GatedRepo", "Access to this model is restricted: accept its conditions")
        if revision not in ("main", repo.commit):
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo

    @app.get("/api/models/{org}/{name}/revision/{revision}")
    async def info(org: str, name: str, revision: str) -> Response:
        repo = find(f"{org}/{name}", revision)
        if isinstance(repo, Response):
            return repo
        return JSONResponse({"id": f"{org}/{name}", "sha": repo.commit,
                             "siblings": [{"rfilename": f} for f in repo.files]})

    @app.get("/api/models/{org}/{name}/tree/{revision}")
    async def tree(org: str, name: str, revision: str) -> Response:
        repo = find(f"{org}/{name}", revision)
        if isinstance(repo, Response):
            return repo
        return JSONResponse([{"type": "file", "path": path, "size": len(content),
                              "oid": hashlib.sha1(content).hexdigest()} for path, content in repo.files.items()])

    @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
    async def resolve(org: str, name: str, revision: str, path: str, request: Request) -> Response:
        repo = find(f"{org}/{name}", revision)
        if isinstance(repo, Response):
            return repo
        if path not in repo.files:
            return _error(404, "EntryNotFound", "Entry not found")
        content = repo.files[path]
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{hashlib.sha256(content).hexdigest()}"'}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(len(content))})
        hub.downloaded.append(f"{org}/{name}/{path}")
        return Response(content, headers=headers, media_type="application/octet-stream")

    return app
