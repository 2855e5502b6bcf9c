"""``vime-train`` joins an existing Ray cluster (``--ray-address`` or ``RAY_ADDRESS``).

Proves, with a real head node started here by ``ray start --head`` (its own
ports, temp dir, process group and auth token; only its processes are stopped
afterwards, never with ``ray stop``, which would stop every Ray on the machine):
a run given the head's address by the ``RAY_ADDRESS`` environment variable
connects to that cluster rather than starting a local one (Ray reports
connecting, never starting, an instance), its driver job and its actors
(training rank, rollout engine) are recorded by that cluster's GCS, placed on the
cluster's GPUs although the driver sees none (the head advertises two GPUs as Ray
resources; torch in the actors still runs on the CPU), the cluster still has its
one node, and the run exits 0 with a metrics line for its rollout.
An address nothing listens on, given by ``--ray-address``, fails in seconds
with exit status 2 and one ``vime-train: error:`` line naming the
address and how to fix it, no traceback, and no output folder left behind;
``start_ray`` refuses such an address (and a malformed one) before
``ray.init``, which would otherwise retry for ever.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.commands import vime_train_command
from vime.config import ConfigError
from vime.ray.cluster import start_ray
from vime.weights.transports import free_port

RUN_FLAGS = [
    "--prompt-data",
    "builtin:reverse",
    "--rollout-engine",
    "hf",
    "--num-rollout",
    "1",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--max-tokens-per-gpu",
    "256",
    "--seed",
    "7",
    # auto would pick NCCL on a cluster with GPUs, and these GPUs are Ray resources only.
    "--weight-sync",
    "object-store",
]

# Reads the cluster as its GCS records it, from a driver of its own (auth handled by Ray).
QUERY = """
import json, sys
import ray
from ray._private import state

ray.init(address=sys.argv[1], log_to_driver=False)
jobs = [
    {"id": j["JobID"], "entrypoint": j.get("Entrypoint", ""), "pid": j.get("DriverProcessID")}
    for j in state.jobs()
]
actors = [
    {"job": a["JobID"], "cls": a["ActorClassName"], "state": a["State"]}
    for a in state.actors().values()
]
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
bundles = [
    list(group["bundles"].values()) for group in ray.util.placement_group_table().values()
]
print("QUERY" + json.dumps({"jobs": jobs, "actors": actors, "nodes": nodes, "bundles": bundles}))
"""


# Ray 2.60 secures a `ray start` head with a token when ~/.ray/auth_token exists, and a
# driver given an explicit address sends one only when told to: every process here is
# told, with a token of this module's own (what a real multi-user cluster looks like).
AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def _env(**extra: str) -> dict[str, str]:
    drop = {"RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(AUTH, **extra)
    return env


@pytest.fixture(scope="module")
def head() -> Iterator[str]:
    """A one-node Ray cluster (4 CPUs, 2 GPUs that are Ray resources only) of this
    module's own; yields its GCS address."""
    # Short: Ray's unix socket paths live under it and must stay under ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="vray", dir="/tmp")
    port = free_port()
    ports = {  # every fixed default port too, so a concurrent Ray on this machine can't clash
        flag: str(free_port())
        for flag in (
            "--ray-client-server-port",
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
            "--node-manager-port",
            "--object-manager-port",
        )
    }
    # Two GPUs as Ray resources only (this machine has none): the run must be placed by
    # what the cluster has, not by what its driver sees.
    command = ["ray", "start", "--head", "--block", "--port", str(port), "--num-cpus", "4"]
    command += ["--num-gpus", "2"]
    command += ["--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir]
    command += [item for pair in ports.items() for item in pair]
    log_path = Path(temp_dir) / "head.log"
    # This interpreter's Ray, not whichever `ray` script the PATH finds first.
    command[:1] = [sys.executable, "-m", "ray.scripts.scripts"]
    with open(log_path, "w") as log:
        # Its own session: the head's daemons share its process group, which is all we stop.
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True
        )
    try:
        address_file = Path(temp_dir) / "ray_current_cluster"
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log_path.read_text() or not address_file.exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        address = address_file.read_text().strip()
        assert address.endswith(f":{port}"), address
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops what it started
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers of this head only
        proc.wait()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _query(address: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", QUERY, address],
        capture_output=True,
        text=True,
        timeout=180,
        env=_env(),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(x for x in result.stdout.splitlines() if x.startswith("QUERY"))
    return json.loads(line.removeprefix("QUERY"))


def test_run_joins_the_running_cluster(head: str, tmp_path: Path) -> None:
    """Given only ``RAY_ADDRESS`` (what ``ray job submit`` sets); the flag reaches the same
    ``start_ray`` argument, as the unreachable-address test below shows."""
    out = tmp_path / "out"
    env = _env(RAY_ADDRESS=head)
    result = subprocess.run(
        [*vime_train_command(), *RUN_FLAGS, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
        env=env,
    )
    text = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert f"Connecting to existing Ray cluster at address: {head}" in text, text[-5000:]
    assert "Started a local Ray instance" not in text, text[-5000:]

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rows] == [0]
    assert rows[0]["weights/version"] == 1

    cluster = _query(head)
    assert len(cluster["nodes"]) == 1, cluster["nodes"]  # the head alone: nothing else joined
    ours = [j for j in cluster["jobs"] if str(out) in j["entrypoint"]]
    assert len(ours) == 1, cluster["jobs"]
    classes = {a["cls"] for a in cluster["actors"] if a["job"] == ours[0]["id"]}
    assert len(classes) >= 2, (classes, cluster["actors"])  # a training rank and an engine
    # The driver sees no CUDA, yet the rank and the engine were placed on the cluster's GPUs.
    assert cluster["bundles"] == [[{"CPU": 1.0, "GPU": 1.0}] * 2], cluster["bundles"]


def test_unreachable_address_fails_fast_with_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # bound, released: nothing listens there
    out = tmp_path / "out"
    # Before the check, this hung for ever (Ray retries the GCS); the timeout is a hang guard.
    result = subprocess.run(
        [*vime_train_command(), *RUN_FLAGS, "--ray-address", address, "--output-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=_env(),
    )
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("vime-train: error: ") and address in errors[0]
    assert "ray start --head" in errors[0] and "RAY_ADDRESS" in errors[0]
    assert "Traceback" not in result.stderr
    assert not out.exists(), sorted(p.name for p in out.iterdir())  # a failed start leaves none


@pytest.mark.timeout(120)  # a hang guard: without the check ray.init retries for ever
@pytest.mark.parametrize("address", ["127.0.0.1:{port}", "ray://127.0.0.1:{port}"])
def test_start_ray_refuses_an_unreachable_address_from_the_environment(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    address = address.format(port=free_port())
    monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConfigError, match="no Ray cluster answers at") as caught:
        start_ray(None, 1)
    assert address in str(caught.value) and "\n" not in str(caught.value)


def test_start_ray_refuses_a_malformed_address() -> None:
    with pytest.raises(ConfigError, match="not host:port"):
        start_ray("my-head-node", 1)
