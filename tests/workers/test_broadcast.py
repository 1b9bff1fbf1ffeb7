"""The weight broadcast trainer → rollout workers over a gloo group of its own (not the default
torch.distributed group): what a worker stages equals what the trainer sent, bit for bit; a
bucket corrupted in transit is caught naming the worker and the tensor; a member that never joins
times out with one line instead of hanging."""
import time

import pytest
import torch

from fastgrpo.sync import broadcast as bc
from async_helpers import async_cfg


def test_checksum_is_exact_and_catches_one_flipped_element():
    t = torch.randn(1000)
    u = t.clone()
    assert bc.checksum(t) == bc.checksum(u)
    u[517] = torch.nextafter(u[517], torch.tensor(float("inf")))  # one ulp
    assert bc.checksum(t) != bc.checksum(u)
    assert bc.checksum(t.bfloat16()) == bc.checksum(t.bfloat16().clone())


def test_a_member_that_never_joins_times_out_naming_the_group():
    store, port = bc.BroadcastGroup.serve("127.0.0.1", 2, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(bc.BroadcastError, match=r"weight-broadcast group at 127.0.0.1:\d+ as rank 0/2 failed within 2 s"):
        bc.BroadcastGroup("127.0.0.1", port, 0, 2, 2, store=store)
    assert time.monotonic() - t0 < 60  # bounded, not a hang (the limit is generous: a busy 2-core box)


@pytest.fixture(scope="module")
def pool(ray_local, tmp_path_factory):
    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.workers.pool import WorkerPool

    cfg = async_cfg(tmp_path_factory.mktemp("bcast"), "rollout.workers=2", "sync.bucket_mb=1")
    p = WorkerPool(cfg, build_worker_engine, log=lambda m: None)
    p.start()
    p.form_group(step=0)
    yield p
    p.close()


def _weights(pool, seed):
    import dataclasses

    from fastgrpo.trainer.build import build_model

    model, _ = build_model(dataclasses.replace(pool.cfg.model, seed=seed))  # the workers' architecture, other values
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_workers_are_ray_actors_named_by_role(pool):
    for pid in pool.pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"RolloutWorker" in f.read()


def test_broadcast_reaches_every_worker_verified(pool, ray_local):
    named = _weights(pool, 1)
    pool.broadcast(named, version=3, step=3)  # raises SyncVerificationError on any mismatch
    # the staged weights load before the next generate call: it reports version 3
    from fastgrpo.rollout.base import SamplingConfig

    refs = [pool.submit(i, 1, [[5, 6, 7]], 2, SamplingConfig(max_new_tokens=3), [11]) for i in range(pool.n)]
    outs = ray_local.get(refs, timeout=60)
    assert [o["version"] for o in outs] == [3, 3]
    assert all(c.policy_version == 3 for o in outs for g in o["groups"] for c in g)
    # same weights, same seed: both workers sample the same completion
    assert outs[0]["groups"][0][0].token_ids == outs[1]["groups"][0][0].token_ids


def test_a_corrupted_bucket_is_caught_naming_worker_and_tensor(pool, ray_local):
    named = _weights(pool, 2)
    ray_local.get(pool.actors[1].inject_fault.remote("corrupt_bucket", 0), timeout=60)
    with pytest.raises(bc.SyncVerificationError) as e:
        pool.broadcast(named, version=4, step=4)
    msg = str(e.value)
    assert "rollout worker 1" in msg and "step 4" in msg and "tensor 'model." in msg and "corrupted" in msg
    pool.broadcast(named, version=5, step=5)  # the next sync is clean again


def test_a_worker_that_cannot_start_fails_at_start_naming_it(ray_local, tmp_path):
    import dataclasses

    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.workers.pool import WorkerError, WorkerPool

    cfg = async_cfg(tmp_path)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(tmp_path / "no-such-model")))
    pool = WorkerPool(cfg, build_worker_engine, log=lambda m: None)
    try:
        with pytest.raises(WorkerError) as e:
            pool.start()
    finally:
        pool.close()
    msg = str(e.value)
    assert msg.startswith("rollout worker 0 could not start (step 0): ") and "\n" not in msg


def test_workers_asking_for_more_than_the_cluster_has_are_refused_before_starting(ray_local, tmp_path):
    from fastgrpo.workers.cluster import start_ray

    cfg = async_cfg(tmp_path, "cluster.address=auto", "cluster.gpus_per_worker=1")  # a joined cluster: checked there
    with pytest.raises(RuntimeError, match=r"rollout.workers=1: the workers need 1 GPU \(1 each\) but the Ray "
                                           r"cluster has 0"):
        start_ray(cfg, log=lambda m: None)
