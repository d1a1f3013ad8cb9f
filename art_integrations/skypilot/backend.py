"""ART's `SkyPilotBackend.initialize_cluster(...)`, which launched a SkyPilot cluster with a GPU and
art's server on it, mapped onto `RayBackend`: the backend as a Ray actor on a GPU node of the Ray
cluster this process connects to (`RAY_ADDRESS`, or `ray.init`'s default), brought up by its
autoscaler where it has one. Each of ART's arguments is honoured or refused by name:

    cluster_name   the actor's name in Ray (`ray list actors`); a live one of that name is reused
    gpu            the GPU type, as Ray labels nodes ("H100": resource accelerator_type:H100)
    env_path       a .env file whose variables the backend's process gets (the store's credentials, HF_TOKEN)
    art_version    "." (ART's "this checkout"): this process's art-integrations and art-backend are sent
                   along; a version string is refused (pin them in the cluster's image)
    force_restart  an actor of that name is stopped first
    resources      refused: a sky.Resources is SkyPilot's; RayBackend(num_gpus=, resources=) says it for Ray
    tail_logs      True is what happens (Ray streams the actor's log here); False is refused

Its checkpoints go to s3://$BACKUP_BUCKET (ART's backup bucket), so `_experimental_pull_from_s3`
and `_experimental_push_to_s3` keep working, and the node's steps outlive it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from art_integrations.checkpoint_sync import s3_url
from art_integrations.ray_backend import NAMESPACE, RayBackend
from art_integrations.ray_rollouts import _ray


class SkyPilotBackend(RayBackend):
    """`await SkyPilotBackend.initialize_cluster(cluster_name=..., gpu="H100", env_path=".env")`."""

    @classmethod
    async def initialize_cluster(cls, cluster_name: str, resources: Any = None, art_version: str | None = None,
                                 env_path: str | None = None, gpu: str | None = None, tail_logs: bool = True,
                                 force_restart: bool = False, **backend_arguments: Any) -> RayBackend:
        """ART's arguments as the module's docstring says; `backend_arguments` are RayBackend's own
        (model=, engine=, settings=, max_restarts=, startup_timeout=, ...)."""
        import asyncio

        if resources is not None:
            raise ValueError("SkyPilotBackend.initialize_cluster(resources=...): a sky.Resources is SkyPilot's; the "
                             "backend here is a Ray actor: RayBackend(num_gpus=..., num_cpus=..., resources={...})")
        if not tail_logs:
            raise ValueError("SkyPilotBackend.initialize_cluster(tail_logs=False): Ray streams the backend actor's log "
                             "to this process; to silence it, ray.init(log_to_driver=False) before this call")
        if art_version not in (None, "."):
            raise ValueError(f"SkyPilotBackend.initialize_cluster(art_version={art_version!r}): the backend runs the "
                             "art-backend installed where the actor runs: pin it in the cluster's image, or pass "
                             "art_version='.' to send this process's art-integrations and art-backend along")
        runtime_env: dict[str, Any] = {}
        if env_path is not None:
            runtime_env["env_vars"] = _env_file(Path(env_path))
        if art_version == ".":
            import art_integrations

            try:
                import art_backend
            except ImportError as error:
                raise ImportError(f"SkyPilotBackend.initialize_cluster(art_version='.') sends this process's "
                                  f"art-backend along, and it has none ({error}): pip install -e ./backend, or "
                                  "leave art_version out and install it in the cluster's image") from error

            runtime_env["py_modules"] = [str(Path(m.__file__).parent) for m in (art_integrations, art_backend)]
        extra = {f"accelerator_type:{gpu}": 0.001} if gpu else {}  # Ray's label of a node's GPU type
        ray = _ray()
        if not ray.is_initialized():
            ray.init()
        if force_restart:
            try:
                ray.kill(ray.get_actor(cluster_name, namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass  # none of that name is running
        return await asyncio.to_thread(lambda: cls(checkpoint_store=s3_url(None, None), num_gpus=1,
                                                   resources=extra, runtime_env=runtime_env, autoscaling=True,
                                                   actor_name=cluster_name, **backend_arguments))


def _env_file(path: Path) -> dict[str, str]:
    """The variables of a .env file, as SkyPilot sends them to the cluster."""
    if not path.is_file():
        raise FileNotFoundError(f"SkyPilotBackend.initialize_cluster(env_path={str(path)!r}): no such file")
    from dotenv import dotenv_values

    return {key: value for key, value in dotenv_values(path).items() if value is not None}

