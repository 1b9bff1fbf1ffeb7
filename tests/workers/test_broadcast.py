"""The weight broadcast trainer → rollout workers, over both transports (sync.transport): a gloo
group of its own (not the default torch.distributed group) and rank 0's shared memory: what a
worker stages equals what the trainer sent, bit for bit; a bucket corrupted in transit is caught
naming the worker and the tensor; a member that never joins times out with one line instead of
hanging; shared memory is taken only where it reaches, and a /dev/shm too small falls back to the
group (auto) or stops with one line (shm)."""
import math
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


@pytest.fixture(scope="module", params=["group", "shm"])
def pool(ray_local, tmp_path_factory, request):
    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.workers.pool import WorkerPool

    cfg = async_cfg(tmp_path_factory.mktemp("bcast"), "rollout.workers=2", "sync.bucket_mb=1",
                    f"sync.transport={request.param}")
    p = WorkerPool(cfg, build_worker_engine, log=lambda m: None)
    p.start()
    p.form_group(step=0)
    assert p.transport == request.param and (p.group is None) == (request.param == "shm")
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
    # a second version over the same buffers (the workers reuse their staging buffers, rank 0 its
    # segment): the workers hold it, not a mix with the first
    named2 = _weights(pool, 7)
    pool.broadcast(named2, version=4, step=4)
    outs2 = ray_local.get([pool.submit(i, 2, [[5, 6, 7]], 2, SamplingConfig(max_new_tokens=3), [11])
                           for i in range(pool.n)], timeout=60)
    assert [o["version"] for o in outs2] == [4, 4]


def test_a_corrupted_bucket_is_caught_naming_worker_and_tensor(pool, ray_local):
    named = _weights(pool, 2)
    ray_local.get(pool.actors[1].inject_fault.remote("corrupt_bucket", 0), timeout=60)
    with pytest.raises(bc.SyncVerificationError) as e:
        pool.broadcast(named, version=5, step=5)
    msg = str(e.value)
    assert "rollout worker 1" in msg and "step 5" in msg and "tensor 'model." in msg and "corrupted" in msg
    # the corrupted copy was never staged: worker 1 samples on under version 4, worker 0 took 5
    from fastgrpo.rollout.base import SamplingConfig

    outs = ray_local.get([pool.submit(i, 3, [[5, 6, 7]], 2, SamplingConfig(max_new_tokens=3), [11])
                          for i in range(pool.n)], timeout=60)
    assert [o["version"] for o in outs] == [5, 4]
    pool.broadcast(named, version=6, step=6)  # the next sync is clean again


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


def test_shared_memory_round_trip_with_split_tensors_and_a_grown_segment():
    """send_shm / ShmReceiver in one process: split tensors (buckets smaller than a tensor) come out
    bit for bit, in buffers from the caller's allocator; a larger payload grows rank 0's segment
    and the receiver maps the new one."""
    from fastgrpo.sync.shm import ShmTransport

    g = torch.Generator().manual_seed(0)
    small = [("model.layers.0.mlp.up_proj.weight", torch.randn(64, 48, generator=g)),
             ("model.norm.weight", torch.randn(48, generator=g))]
    big = small + [("lm_head.weight", torch.randn(300, 48, generator=g))]
    channel, rx, staging = ShmTransport(n_buffers=1), bc.ShmReceiver(track=True), bc.StagingBuffers()
    try:
        for named in (small, big, small):
            buckets = bc.plan(named, 4096)  # 4 KiB buckets: every weight is split
            assert any(len({e[0] for e in b}) == 1 and e[5] < math.prod(e[2]) for b in buckets for e in b)
            bufs = []
            out = rx.receive(bc.send_shm(channel, named, buckets), buckets,
                             alloc=lambda n, d: bufs.append(staging.take(n, d)) or bufs[-1])
            assert set(out) == {n for n, _ in named}
            for n, t in named:
                assert torch.equal(out[n], t), n
            assert len(bufs) == len(buckets)
            staging.give(bufs)
        assert channel.nbytes >= bc.shm_layout(bc.plan(big, 4096))[1]
    finally:
        rx.close()
        channel.close()


def test_staging_buffers_are_reused_and_never_lent_twice():
    s = bc.StagingBuffers()
    a, b = s.take(1024), s.take(1024)
    assert a.data_ptr() != b.data_ptr()
    s.give([a])
    c = s.take(1024)
    assert c.data_ptr() == a.data_ptr()  # the returned one, not fresh pages
    assert s.take(1024).data_ptr() not in (b.data_ptr(), c.data_ptr())  # lent ones stay lent
    assert s.take(2048).numel() == 2048


def test_shared_memory_is_taken_only_for_workers_on_this_node(ray_local, tmp_path):
    from fastgrpo.workers.pool import WorkerError, WorkerPool

    here = ray_local.get_runtime_context().get_node_id()
    for transport, nodes, want in [("auto", [here, here], "shm"), ("auto", [here, "elsewhere"], "group"),
                                   ("group", [here, here], "group"), ("shm", [here, here], "shm")]:
        p = WorkerPool(async_cfg(tmp_path, "rollout.workers=2", f"sync.transport={transport}"), None)
        p.nodes = nodes
        assert p._choose_transport(step=0) == want, (transport, nodes)
    p = WorkerPool(async_cfg(tmp_path, "rollout.workers=2", "sync.transport=shm"), None)
    p.nodes, p.pids = [here, "elsewhere"], [11, 12]
    with pytest.raises(WorkerError, match=r"sync.transport=shm at step 3: rollout worker 1 \(pid 12\) runs on "
                                          r"another node than the trainer .* use sync.transport=group"):
        p._choose_transport(step=3)


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_a_dev_shm_too_small_falls_back_to_the_group_or_stops_naming_it(ray_local, tmp_path, monkeypatch, transport):
    from fastgrpo.sync import shm
    from fastgrpo.trainer.async_trainer import build_worker_engine
    from fastgrpo.workers.pool import WorkerError, WorkerPool

    monkeypatch.setattr(shm, "shm_free_bytes", lambda: 4096)  # rank 0's /dev/shm: 4 KiB free
    logs = []
    p = WorkerPool(async_cfg(tmp_path, f"sync.transport={transport}"), build_worker_engine, log=logs.append)
    try:
        p.start()
        p.form_group(step=0)
        assert p.transport == "shm"
        named = _weights(p, 3)
        if transport == "shm":
            with pytest.raises(WorkerError, match=r"weight broadcast of version 1 at step 0: shared memory: 1 × \d+ "
                                                  r"MiB needed, /dev/shm has 0 MiB free; make /dev/shm larger or use "
                                                  r"sync.transport=group"):
                p.broadcast(named, version=1, step=0)
            return
        p.broadcast(named, version=1, step=0)  # verified, over the group
        assert p.transport == "group" and p.group is not None
        assert any("broadcasting over the group instead" in m for m in logs)
        p.restart(0, step=1)  # a restart re-forms the group: auto stays on the group
        p.form_group(step=1)
        assert p.transport == "group"
        p.broadcast(named, version=2, step=1)
    finally:
        p.close()


def test_a_segment_the_filesystem_cannot_reserve_fails_naming_it(monkeypatch):
    """posix_fallocate reserves the segment's pages at creation: a full /dev/shm raises OSError
    naming the size (instead of a SIGBUS at the first write); a filesystem without reservation
    (EOPNOTSUPP) keeps the segment, checked by free space alone."""
    import errno
    import os

    from fastgrpo.sync import shm

    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    t = shm.ShmTransport(n_buffers=1)
    with pytest.raises(OSError, match=r"shared memory: reserving 1 MiB in /dev/shm failed: No space left on device"):
        t.ensure(1 << 20)
    assert t.buffers == [] and t.nbytes == 0

    def unsupported(fd, off, n):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    try:
        assert t.ensure(1 << 20) and len(t.buffers) == 1 and t.buffers[0].numel() == 1 << 20
        t.buffers[0][-1] = 7
    finally:
        t.close()


def test_closing_a_segment_removes_its_name_even_when_close_refuses(monkeypatch):
    """SharedMemory.close raises BufferError while a view of it is exported (an engine in this
    process); the segment's name must go anyway — a POSIX name outlives its mappings, and a
    process killed later (a Ray actor) would leave it in /dev/shm for good."""
    import os
    from multiprocessing import shared_memory

    from fastgrpo.sync import shm

    t = shm.ShmTransport(n_buffers=2)
    t.ensure(4096)
    names = [s.name for s in t._shms]
    real = shared_memory.SharedMemory.close

    def refuse(self):
        raise BufferError("cannot close exported pointers exist")

    monkeypatch.setattr(shared_memory.SharedMemory, "close", refuse)
    t.close()
    monkeypatch.setattr(shared_memory.SharedMemory, "close", real)
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
