"""RayBackend on a real Ray cluster: `ray.cluster_utils.Cluster` starts a head node and a node that
declares one H100 (`num_gpus=1` and Ray's `accelerator_type:H100` label: the tiny model's engine
runs on its CPU), with moto's S3 server on loopback as the checkpoint store. Started as an ART
script starts one (`SkyPilotBackend.initialize_cluster(..., gpu="H100", env_path=".env")`, then
`_experimental_pull_from_s3`), the actor lands on the GPU node and no other; killed outright
(SIGKILL, as a lost node), Ray starts it again on a fresh art dir and it resumes from the store at
the last acknowledged step; a cluster without the resource is refused at once, or after the stated
wait with `autoscaling=True`. Nothing of Ray is mocked.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # the test cluster stays on loopback (test_ray.py)
ray = pytest.importorskip("ray", reason="RayBackend's tests need the ray extra (`make test` installs it)")

from ray.cluster_utils import Cluster  # noqa: E402

from art_integrations import BackendError, RayBackend, TrainableModel, TrainConfig  # noqa: E402
from art_integrations.skypilot import SkyPilotBackend  # noqa: E402
from tests.conftest import scored_group  # noqa: E402
from tests.test_checkpoint_sync import BUCKET, _keys  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::PendingDeprecationWarning")
AWS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE",
       "AWS_SHARED_CREDENTIALS_FILE")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, str]]:
    """A head node with one CPU and a node with one CPU and one GPU (declared); the latter's id."""
    health = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}
    started = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "_system_config": health})
    gpu_node = started.add_node(num_cpus=1, num_gpus=1, resources={"accelerator_type:H100": 1})
    ray.init(address=started.address)
    yield started, gpu_node.node_id
    ray.shutdown()
    started.shutdown()


async def _train_step(model: TrainableModel, scenario: str) -> int:
    return (await model.train([await scored_group(model, scenario, [0.0, 1.0])], TrainConfig(learning_rate=1e-3))).step


async def test_the_backend_lands_on_the_gpu_node_and_a_killed_actor_resumes_from_the_store(
        cluster: tuple[Cluster, str], s3: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, gpu_node = cluster
    monkeypatch.setenv("BACKUP_BUCKET", BUCKET)  # ART's backup bucket: the checkpoint store
    env_file = tmp_path / ".env"  # the store's credentials travel to the actor as SkyPilot sends a .env
    env_file.write_text("".join(f"{name}={os.environ[name]}\n" for name in AWS))
    backend = await SkyPilotBackend.initialize_cluster(cluster_name="art-test", gpu="H100", env_path=str(env_file),
                                                       model="tiny-random-smollm2", engine="torch", max_restarts=1,
                                                       startup_timeout=300)
    try:
        assert ray.util.list_named_actors(all_namespaces=True) == [{"name": "art-test", "namespace": "art"}]
        first = backend.where()
        assert first["node_id"] == gpu_node  # the only node with the GPU it asked for
        model = TrainableModel(name="agent", project="placed")
        await backend._experimental_pull_from_s3(model)  # as ART's scripts do: nothing there yet, said so
        await model.register(backend)
        assert await _train_step(model, "a") == 1
        assert await _train_step(model, "b") == 2
        assert {"checkpoints/0001/adapter_model.safetensors", "checkpoints/0002/adapter_model.safetensors"} <= \
            _keys(s3, "placed/models/agent/")  # acknowledged: in the store

        os.kill(first["pid"], signal.SIGKILL)  # the node's process lost, as to the OOM killer or a lost node
        assert await model.get_step() == 2  # Ray started it again; the model was registered again from the store
        again = backend.where()
        assert again["pid"] != first["pid"] and again["node_id"] == gpu_node and again["url"] == backend.base_url
        assert [r["step"] for r in await model.history()] == [1, 2]
        reply = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(1), max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None  # an older step is served from the pulled files
        assert await _train_step(model, "c") == 3  # training goes on from the pulled adapter
    finally:
        await backend.close()
    assert ray.util.list_named_actors(all_namespaces=True) == []  # stopped, nothing left behind


def test_a_script_that_exits_without_close_leaves_no_backend_behind(cluster: tuple[Cluster, str], tmp_path: Path) -> None:
    started, _ = cluster
    script = tmp_path / "script.py"
    script.write_text(
        "import ray\n"
        "from art_integrations import RayBackend\n"
        f"ray.init(address={started.address!r})\n"
        f"backend = RayBackend(checkpoint_store={(tmp_path / 'store').as_uri()!r}, model='tiny-random-smollm2', "
        "engine='torch', actor_name='left-open')\n"
        "print(backend.where()['node_id'])\n")  # and exits: no close()
    subprocess.run([sys.executable, str(script)], check=True, timeout=300, capture_output=True,
                   env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    deadline = time.monotonic() + 30
    while ray.util.list_named_actors(all_namespaces=True) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.util.list_named_actors(all_namespaces=True) == []  # Ray removed the actor its driver owned


def test_a_cluster_without_the_resource_is_refused_with_what_it_has(cluster: tuple[Cluster, str]) -> None:
    with pytest.raises(BackendError, match=r"asks for \{'CPU': 1.0, 'GPU': 2.0\}, and no live node of the cluster "
                                           r"had that \(nodes: .*CPU=1, GPU=1.*\)\. Add a node with it"):
        RayBackend(num_gpus=2, checkpoint_store="s3://bucket/prefix")
    started = time.monotonic()
    with pytest.raises(BackendError, match=r"no live node of the cluster had that within 3 s"):
        RayBackend(num_gpus=1, resources={"TPU": 1}, checkpoint_store="s3://bucket/prefix", autoscaling=True,
                   startup_timeout=3)
    assert time.monotonic() - started < 30  # the stated wait, then the actor asked for is removed


def test_what_ray_backend_and_skypilots_initialize_cluster_refuse(cluster: tuple[Cluster, str],
                                                                  tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="name the store every step is pushed to"):
        RayBackend(checkpoint_store="bucket/prefix")
    with pytest.raises(ValueError, match=r"settings=\.\.\.\) names \['art_dir'\]"):
        RayBackend(checkpoint_store="s3://b", settings={"art_dir": "/tmp"})
    for arguments, refusal in (({"resources": object()}, "a sky.Resources is SkyPilot's"),
                               ({"tail_logs": False}, "log_to_driver=False"),
                               ({"art_version": "0.3.11"}, "pin it in the cluster's image"),
                               ({"env_path": str(tmp_path / "missing.env")}, "no such file")):
        with pytest.raises((ValueError, FileNotFoundError), match=refusal):
            asyncio.run(SkyPilotBackend.initialize_cluster("art", gpu="H100", **arguments))
