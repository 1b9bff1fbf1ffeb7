"""Rollout workers on more than one Ray node (issue 34), on this one machine.

`ray.cluster_utils.Cluster` runs a head and extra raylet nodes, each with its own resources and
node id: the head (the trainer's node) offers no CPU, so the worker lands on another node; the
nodes share this machine's /dev/shm, so what is checked is the decision — `sync.transport=auto`
takes the group because the worker's node id is not the trainer's — and that every sync over it
is verified. Removing the worker's node mid-run restarts it on the node left; removing that one
too stops the run within seconds with one line naming the node (nothing waits for a node that
may never come back). And a run joins a head started with `ray start --head` through
`cluster.address`, as docs/guides/async.md says.

Ray's address file (`ray_current_cluster`) goes to a private RAY_TMPDIR: in /tmp/ray, another
process's `ray.init()` on this machine would join these clusters instead of starting its own.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from async_helpers import async_cfg
from trainer_helpers import NoisyTask

ray = pytest.importorskip("ray")
NODE = dict(object_store_memory=80 << 20)


@pytest.fixture
def ray_tmp(monkeypatch):
    d = tempfile.mkdtemp(prefix="fgr-", dir="/tmp")  # short: Ray's socket paths below it must fit 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _trainer(cfg, said):
    from fastgrpo.trainer.async_trainer import AsyncTrainer
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.grpo import seed_everything

    seed_everything(cfg.seed)
    model, tok = build_model(cfg.model)
    return AsyncTrainer(cfg, model, tok, NoisyTask(), log=said.append)


def test_a_worker_on_another_node_syncs_over_the_group_and_outlives_its_node(ray_tmp, tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    from fastgrpo.sync import broadcast as bc
    from fastgrpo.trainer.update import TrainingStopped

    verified = []
    verify = bc.verify

    def spy(expected, got, who, version, got_version):
        verify(expected, got, who, version, got_version)  # raises on any difference
        verified.append(version)

    monkeypatch.setattr(bc, "verify", spy)
    # the head is this process's node (the trainer's) and offers no CPU: the worker runs on a node of its own
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False, **NODE))
    tr, said = None, []
    try:
        nodes = {n.node_id: n for n in (cluster.add_node(num_cpus=1, **NODE) for _ in range(2))}
        ray.init(address=cluster.address, include_dashboard=False, configure_logging=False)
        here = ray.get_runtime_context().get_node_id()
        # in line (sync.overlap=false): a sync to a worker whose node is gone fails in its own step
        cfg = async_cfg(tmp_path, "rollout.workers=1", "rollout.max_staleness=1", "sync.transport=auto",
                        "sync.overlap=false", "steps=4")
        tr = _trainer(cfg, said)
        pool = tr.orchestrator.pool
        first = pool.nodes[0]
        assert first in nodes and first != here
        assert pool.transport == "group"  # shared memory reaches the trainer's node only
        assert any("over a process group" in m for m in said), said
        tr.step()
        tr.step()
        cluster.remove_node(nodes[first])  # mid-run: the worker dies with its node
        tr.step()
        second = pool.nodes[0]
        assert pool.restarts == 1 and second in nodes and second != first
        assert pool.transport == "group"
        assert any(f"with its Ray node {first[:12]}" in m and "restarting it on another node" in m for m in said), said
        assert sorted(set(verified)) == [0, 1, 2, 3], verified  # every version reached the worker, verified
        cluster.remove_node(nodes[second])  # no node left that offers a CPU
        t0 = time.monotonic()
        with pytest.raises(TrainingStopped) as e:
            tr.step()
        took = time.monotonic() - t0
    finally:
        if tr is not None:
            tr.close()
        ray.shutdown()
        cluster.shutdown()
    msg = str(e.value)
    assert "\n" not in msg and f"with its Ray node {second[:12]}" in msg and "which left the cluster" in msg, msg
    assert "add a node or lower rollout.workers" in msg, msg
    assert took < 30, f"{took:.1f} s to stop: {msg}"


def test_room_for_the_workers_is_counted_per_node_and_a_node_that_left_is_named(tmp_path, monkeypatch):
    """No Ray started: WorkerPool reads ray.nodes(). Three CPUs on one node and one on another hold
    one worker of two CPUs, not two (a start waited 300 s for a place that does not exist)."""
    from fastgrpo.workers.pool import WorkerPool

    cfg = async_cfg(tmp_path, "rollout.workers=2", "rollout.worker_threads=2", "cluster.num_cpus=8",
                    "cluster.gpus_per_worker=0")
    pool = WorkerPool(cfg, build_engine=None, log=lambda m: None)
    nodes = [{"NodeID": "a" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 3.0}},
             {"NodeID": "b" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 1.0}},
             {"NodeID": "c" * 56, "Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 8.0}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert pool.unplaceable() == ("the live Ray nodes (3 CPU, 1 CPU) hold 1 of the 2 worker(s) of 2 CPU each; "
                                  "add a node or lower rollout.workers / rollout.worker_threads")
    nodes.append({"NodeID": "d" * 56, "Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 2.0}})
    assert pool.unplaceable() is None
    assert pool.node_left("a" * 56) is None
    assert pool.node_left("c" * 56) == "Ray node cccccccccccc (10.0.0.3)"
    assert pool.node_left("e" * 56) == "Ray node eeeeeeeeeeee"


def test_only_a_head_on_this_machine_gets_this_machine_s_token_unasked(monkeypatch):
    from fastgrpo.workers import cluster

    assert cluster._on_this_machine("127.0.0.1:6379") and cluster._on_this_machine("localhost:6379")
    assert not cluster._on_this_machine("203.0.113.9:6379")  # TEST-NET-3: nobody's
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert cluster._join_auth("203.0.113.9:6379") is False and "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the user's own setting wins
    assert cluster._join_auth("127.0.0.1:6379") is False and os.environ["RAY_AUTH_MODE"] == "disabled"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_a_run_joins_a_head_started_with_ray_start_through_cluster_address(ray_tmp, tmp_path, monkeypatch):
    """As a user's shell would (no RAY_AUTH_MODE): where a Ray token exists (Ray's first `ray.init()`
    writes ~/.ray/auth_token) the head asks for it, and the run presents it (it failed after ~30 s
    with "Failed to connect to Ray cluster" before)."""
    assert not ray.is_initialized()
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    port = _free_port()
    # `ray stop` would stop every Ray on the machine: the head runs in the foreground (--block) and
    # goes with its own processes on SIGTERM
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block", f"--port={port}",
           "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={ray_tmp}", "--disable-usage-stats"]
    head = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out, up = [], threading.Event()

    def read():
        for line in head.stdout:
            out.append(line)
            if "Ray runtime started" in line:
                up.set()
        up.set()  # it exited

    threading.Thread(target=read, daemon=True).start()
    said = []
    try:
        assert up.wait(120) and head.poll() is None, "".join(out)[-3000:]
        cfg = async_cfg(tmp_path, f"cluster.address=127.0.0.1:{port}", "rollout.workers=1", "steps=2")
        tr = _trainer(cfg, said)
        try:
            logs = [tr.step() for _ in range(cfg.steps)]
            pool = tr.orchestrator.pool
            node, restarts = pool.nodes[0], pool.restarts
        finally:
            tr.close()
        assert not ray.is_initialized()  # the run left the cluster (and did not stop it)
        assert _listening(port)
    finally:
        head.send_signal(signal.SIGTERM)
        head.wait(60)
    assert any(f"Ray joined at 127.0.0.1:{port}" in m for m in said), said
    assert node and restarts == 0
    assert [m["async/version"] for m in logs] == [1.0, 2.0]
    assert len(tr.trained_indices) == cfg.steps * cfg.rollout.prompts_per_step
    deadline = time.monotonic() + 30
    while _listening(port) and time.monotonic() < deadline:  # its GCS goes with the head process
        time.sleep(0.1)
    assert not _listening(port)
