"""`RayBackend`: the bundled backend started by Ray as an actor on a node with the resources asked
for (a GPU), from the client, and stopped with it; its models kept in an object store, so they
outlive the node.

    backend = RayBackend(num_gpus=1, checkpoint_store="s3://my-bucket/art", address="auto", autoscaling=True)
    await model.register(backend)      # then as with any backend: train, openai_client(), checkpoints

On a cluster with an autoscaler (Ray's cluster launcher, KubeRay), the actor asking for a GPU is what
brings up a GPU node, and the node goes away once idle after `close()`. The node's disk is scratch:
the backend pushes every step and every logged score to `checkpoint_store` before it answers, and
a model registering pulls from there what the node lacks (the backend's `checkpoint_store`
setting, art_backend/training/mirror.py). So when the actor dies (its node lost, a spot instance
taken back), Ray starts it again, on whichever node has the resources, and the next request finds
it there: the models registered so far are registered again, resuming at the newest step the store
holds, and a request that read nothing is sent again; one that may have changed something (a train
step in flight) is refused, saying so, since only what was acknowledged is in the store.

Needs the `ray` extra on the client, and art-backend where the actor runs (the cluster's image or
`runtime_env`). Ray is connected as `RayRollouts` connects it (`ray.init(address)` unless this
process already is), and left connected.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

import httpx

from art_integrations.backend import ENGINES, Backend, BackendError
from art_integrations.capture.transports.core import known_backend
from art_integrations.ray_rollouts import _ray

logger = logging.getLogger(__name__)

# settings RayBackend sets itself, or takes as arguments of its own
_OWN_SETTINGS = {"host", "port", "art_dir", "api_key", "model", "engine", "checkpoint_store",
                 "checkpoint_store_options"}
REGISTER = "/v1/training/models"  # the request that registers a model (replayed on a restarted actor)
NAMESPACE = "art"  # the Ray namespace of named backends (`actor_name=`)


class BackendActor:
    """The Ray actor: art-backend serving on this node's address, its art dir a scratch folder of
    the node (each start a fresh one: what lasts is in the checkpoint store)."""

    def __init__(self, settings: dict[str, Any], startup_timeout: float) -> None:
        import tempfile

        import uvicorn
        from art_backend.app import build_app
        from art_backend.config import BackendSettings

        ray = _ray()
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        art_dir = tempfile.mkdtemp(prefix="art-ray-backend-")
        # the actor's process is the backend's own: it may tune that process's memory (the CLI's default);
        # its log reaches the driver's output, so what needs attention only, unless asked (settings=)
        config = BackendSettings(**{"tune_process_memory": True, "log_level": "warning", **settings, "host": host,
                                    "port": port, "art_dir": art_dir})
        self._server = uvicorn.Server(uvicorn.Config(build_app(config), host=host, port=port,
                                                     log_level=config.log_level))
        self._thread = threading.Thread(target=self._server.run, name="art-backend", daemon=True)
        self._thread.start()
        self.url, self.api_key = f"http://{host}:{port}", config.api_key
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline and self._thread.is_alive():
            try:
                headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
                if httpx.get(f"{self.url}/health", headers=headers, timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"art-backend did not serve at {self.url} within {startup_timeout:.0f} s"
                           + ("" if self._thread.is_alive() else ": its server stopped (its log says why)"))

    def address(self) -> tuple[str, str | None]:
        """Where the backend serves and its key (an actor of that name reused has its own)."""
        return self.url, self.api_key

    def where(self) -> dict[str, Any]:
        """The node and process the backend runs in."""
        import os

        return {"node_id": _ray().get_runtime_context().get_node_id(), "pid": os.getpid(), "url": self.url}

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=60)


class RayBackend(Backend):
    """The bundled backend placed by Ray: see the module's docstring.

    `checkpoint_store`: where every step and score is pushed (any fsspec URL the actor's node can
    reach with its own credentials: s3://bucket/prefix, gs://..., file:///shared/path), with
    `storage_options` for fsspec. `num_gpus`, `num_cpus`, `memory` (bytes), `resources`: what the
    actor reserves. `model`, `engine`: as LocalBackend's; `settings`: any other backend setting
    (`art-backend serve --help`: e.g. {"max_lora_rank": 32}). `address`: as `ray.init`'s.
    `autoscaling`: if no live node has the resources, wait up to `startup_timeout` seconds for
    the node an autoscaler adds; without it such a backend is refused at once. `max_restarts`: how
    often Ray starts a lost actor again (-1: without limit). `runtime_env`: the actor's environment
    (`env_vars` for the store's credentials, `pip`, ...). `api_key`: the backend's; by default a
    random one, since it listens on the node's address. `actor_name`: a name for the actor in Ray's
    "art" namespace; a live actor of that name (this process's) is used instead of a new one.
    """

    def __init__(self, *, checkpoint_store: str, num_gpus: float = 1, num_cpus: float = 1, memory: int | None = None,
                 resources: Mapping[str, float] | None = None, model: str | None = None, engine: str = "auto",
                 settings: Mapping[str, Any] | None = None, storage_options: Mapping[str, Any] | None = None,
                 address: str | None = None, autoscaling: bool = False, startup_timeout: float = 900.0,
                 max_restarts: int = 3, runtime_env: Mapping[str, Any] | None = None,
                 api_key: str | None = None, actor_name: str | None = None) -> None:
        if not isinstance(checkpoint_store, str) or "://" not in checkpoint_store:
            raise ValueError(f"RayBackend(checkpoint_store={checkpoint_store!r}): name the store every step is "
                             "pushed to as a URL (s3://bucket/prefix, gs://bucket/prefix, file:///shared/path): "
                             "the actor's node is scratch, and its steps would be lost with it")
        if engine not in ENGINES:
            raise ValueError(f"RayBackend(engine={engine!r}): use one of {', '.join(map(repr, ENGINES))}")
        for name, value in (("num_gpus", num_gpus), ("num_cpus", num_cpus), *(resources or {}).items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"RayBackend: {name}={value!r}: the actor's resources are numbers >= 0")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
            raise ValueError(f"RayBackend: max_restarts={max_restarts!r}: a count >= 0, or -1 for no limit")
        if startup_timeout <= 0:
            raise ValueError(f"RayBackend: startup_timeout={startup_timeout!r}: seconds, > 0")
        if clash := sorted(_OWN_SETTINGS & set(settings or {})):
            raise ValueError(f"RayBackend(settings=...) names {clash}: pass model=, engine=, checkpoint_store=, "
                             "storage_options= and api_key= as RayBackend's own arguments; the host, port and "
                             "art dir are the actor's node's")
        api_key = api_key or secrets.token_urlsafe(24)
        server_settings = {**(settings or {}), "model": model, "engine": engine, "api_key": api_key,
                           "checkpoint_store": checkpoint_store, "checkpoint_store_options": dict(storage_options or {})}
        self.checkpoint_store = checkpoint_store
        self._wanted = {"CPU": float(num_cpus), "GPU": float(num_gpus), **(resources or {})}
        if memory is not None:
            self._wanted["memory"] = float(memory)
        self._startup_timeout = startup_timeout
        self._registered: dict[tuple[str, str], Any] = {}  # (project, name) -> its register request's body
        self._following: asyncio.Lock | None = None  # one request follows a restarted actor; the others wait
        ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address)
        elif address is not None:
            logger.info("RayBackend: Ray is already initialized in this process; using that cluster, not %s", address)
        if not autoscaling and not self._fits():
            raise BackendError(self._no_node_message())
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "resources": dict(resources or {}),
                                   "memory": memory, "max_restarts": max_restarts, "max_task_retries": -1,
                                   "runtime_env": dict(runtime_env or {}) or None}
        if actor_name is not None:
            options.update(name=actor_name, namespace=NAMESPACE, get_if_exists=True)
        self._actor: Any = ray.remote(BackendActor).options(**options).remote(server_settings, startup_timeout)
        try:
            url, api_key = self._actor_address(startup_timeout)
        except BaseException:  # never placed, or failed to start: nothing to stop cleanly
            ray.kill(self._actor, no_restart=True)
            self._actor = None
            raise
        super().__init__(url, api_key=api_key)

    # ----- placement ----------------------------------------------------------------------

    def _fits(self) -> bool:
        nodes = [node["Resources"] for node in _ray().nodes() if node["Alive"]]
        wanted = {name: amount for name, amount in self._wanted.items() if amount > 0}
        return any(all(node.get(name, 0.0) >= amount for name, amount in wanted.items()) for node in nodes)

    def _no_node_message(self, waited: float | None = None) -> str:
        nodes = [node["Resources"] for node in _ray().nodes() if node["Alive"]]
        have = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(node.items()) if k in self._wanted) or "-"
                         for node in nodes)
        wanted = {name: amount for name, amount in self._wanted.items() if amount > 0}
        when = "" if waited is None else f" within {waited:.0f} s"
        return (f"RayBackend: the backend asks for {wanted}, and no live node of the cluster had that{when} (nodes: "
                f"{have or 'none'}). Add a node with it (`ray start --num-gpus=1 ...`; on a cluster launcher, a worker "
                "type with it), ask for less (num_gpus=, num_cpus=, resources=), or on an autoscaling cluster pass "
                "autoscaling=True and a startup_timeout long enough for a node to boot.")

    def _actor_address(self, timeout: float) -> tuple[str, str | None]:
        """The actor's URL and key once it serves; a clear error if it is not placed or fails to start."""
        ray = _ray()
        reference = self._actor.address.remote()
        ready, _ = ray.wait([reference], timeout=timeout)
        if not ready:
            if not self._fits():
                raise BackendError(self._no_node_message(timeout))
            raise BackendError(f"RayBackend: the backend was placed but did not serve within {timeout:.0f} s (loading "
                               "or downloading the model takes that long?): raise startup_timeout")
        try:
            return ray.get(reference)
        except ray.exceptions.RayError as error:
            raise BackendError(f"RayBackend: the backend's actor failed to start: {error}") from error

    def where(self) -> dict[str, Any]:
        """The Ray node id, process id and URL of the backend's actor now."""
        return _ray().get(self._actor.where.remote(), timeout=self._startup_timeout)

    # ----- requests, across restarts of the actor -----------------------------------------------

    async def request(self, method: str, path: str, json: Any = None) -> Any:
        try:
            answer = await super().request(method, path, json)
        except BackendError as error:
            if not isinstance(error.__cause__, httpx.TransportError) or self._actor is None:
                raise
            lost = self.base_url
            self._following = self._following or asyncio.Lock()
            async with self._following:
                if self.base_url == lost:  # no other request has followed it yet
                    await self._follow_actor()
            if method == "GET":
                return await super().request(method, path, json)
            raise BackendError(
                f"{method} {path}: the backend at {lost} was lost while this request ran, and Ray started it again "
                f"at {self.base_url}, resuming every registered model at the newest step in {self.checkpoint_store}. "
                "Whatever was acknowledged is there; this request was not: `await model.get_step()` says where "
                "training stands; send it again.") from error
        if method == "POST" and path == REGISTER and isinstance(json, dict):
            self._registered[(json.get("project"), json.get("name"))] = json
        return answer

    async def _follow_actor(self) -> None:
        """Wait for Ray's restart of the actor, move to its address, register the models again."""
        ray = _ray()
        try:
            url, _ = await asyncio.to_thread(ray.get, self._actor.address.remote(), timeout=self._startup_timeout)
        except ray.exceptions.RayError as error:
            raise BackendError(f"RayBackend: the backend's actor is gone and did not come back ({error}); its steps are "
                               f"in {self.checkpoint_store}: a new RayBackend resumes from there") from error
        if url != self.base_url:
            logger.warning("RayBackend: the backend moved from %s to %s (Ray restarted its actor)", self.base_url, url)
            headers, timeout = self._http.headers, self._http.timeout
            await self._http.aclose()
            self.base_url = url
            known_backend(url)
            self._http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout)
            client = self._openai_clients.pop(asyncio.get_running_loop(), None)
            if client is not None:
                await client.close()
            self._openai_clients.clear()  # openai_client() gives clients of the new address from now on
        for body in list(self._registered.values()):
            await Backend.request(self, "POST", REGISTER, body)

    # ----- lifecycle ------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the backend and its actor (what `close()` does besides closing the connections);
        the node is left to Ray's autoscaler."""
        actor, self._actor = getattr(self, "_actor", None), None
        if actor is None:
            return
        ray = _ray()
        try:
            ray.get(actor.stop.remote(), timeout=60)
        except ray.exceptions.RayError as error:
            logger.warning("RayBackend: the backend's actor did not stop cleanly (%s); killing it", error)
        ray.kill(actor, no_restart=True)

    async def close(self) -> None:
        await super().close()
        self.stop()
