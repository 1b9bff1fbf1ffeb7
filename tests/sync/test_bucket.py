"""Bucket planning, packing and receiving (no engine): byte-exact round trips at bucket sizes
that force many buckets, split tensors and groups straddling buckets; the sender's double
buffering over shared memory; name checks; the torch engine's direct copy."""
import pytest
import torch

from fastgrpo.sync.bucket import (ALIGN, BucketReceiver, load_group, named_specs, pack_bucket, plan_buckets,
                                  bucket_nbytes)
from fastgrpo.sync.direct import copy_weights
from fastgrpo.sync.sender import BucketedSender, check_names, sync_per_parameter
from fastgrpo.sync.shm import ShmTransport
from fastgrpo.sync import shm as shm_mod


def _named(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (37, 16),
        "model.layers.0.self_attn.q_proj.weight": (16, 16),
        "model.layers.0.self_attn.q_proj.bias": (16,),
        "model.layers.0.self_attn.k_proj.weight": (8, 16),
        "model.layers.0.self_attn.v_proj.weight": (8, 16),
        "model.layers.0.mlp.gate_proj.weight": (24, 16),
        "model.layers.0.mlp.up_proj.weight": (24, 16),
        "model.layers.0.mlp.down_proj.weight": (16, 24),
        "model.layers.0.input_layernorm.weight": (16,),
        "model.norm.weight": (16,),
        "lm_head.weight": (37, 16),
    }
    return [(n, torch.randn(s, generator=g)) for n, s in shapes.items()]


class FakeWorker:
    """The engine side of worker_ext without vLLM: records what a reload would receive."""

    def __init__(self):
        self.loaded = {}
        self.calls = []
        self.receiver = BucketReceiver()
        self.buffers = None

    def rpc(self, method, *args):
        self.calls.append(method)
        if method == "fastgrpo_attach":
            self.buffers, self._keep = shm_mod.attach(args[0])
            return len(self.buffers)
        if method == "fastgrpo_load_bucket":
            ready = self.receiver.receive(self.buffers[args[0]], args[1])
            self._check_groups(ready)
            self.loaded.update({n: t.clone() for n, t in ready})
            return len(ready)
        if method == "fastgrpo_load_named":
            ready = self.receiver.receive_named(args[0])
            self._check_groups(ready)
            self.loaded.update({n: t.clone() for n, t in ready})
            return len(ready)
        if method == "fastgrpo_finish":
            left = self.receiver.incomplete()
            self.receiver.reset()
            self._done = set()
            return left
        raise AssertionError(method)

    def _check_groups(self, ready):
        # every load must deliver whole groups (vLLM processes a fused layer only when complete)
        groups = {}
        for n, _ in ready:
            groups.setdefault(load_group(n), []).append(n)
        for g, names in groups.items():
            assert g not in getattr(self, "_done", set()), f"group {g} delivered twice"
            self._done = getattr(self, "_done", set()) | {g}


@pytest.mark.parametrize("bucket_bytes", [ALIGN, 512, 1000, 4096, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_pack_receive_round_trip(bucket_bytes, dtype):
    named = _named()
    plan = plan_buckets(named_specs(named, dtype), bucket_bytes)
    # one shared buffer reused by every bucket: pieces that wait for a later bucket must survive
    buf = torch.zeros(bucket_bytes, dtype=torch.uint8)
    rx = BucketReceiver()
    got = {}
    seen = set()
    for bucket in plan:
        assert bucket_nbytes(bucket) <= bucket_bytes
        spans = sorted((e.offset, e.offset + e.nbytes) for e in bucket)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), "overlapping slices"
        assert all(e.offset % ALIGN == 0 for e in bucket)
        buf.fill_(0xAB)
        pack_bucket(buf, bucket, dict(named))
        ready = rx.receive(buf, bucket)
        groups = {load_group(n) for n, _ in ready}
        assert not groups & seen, f"groups delivered in two pieces: {groups & seen}"
        seen |= groups
        got.update({n: t.clone() for n, t in ready})
    assert rx.incomplete() == []
    assert set(got) == {n for n, _ in named}
    for n, t in named:
        assert got[n].dtype == dtype and got[n].shape == t.shape
        assert torch.equal(got[n], t.to(dtype)), n
    if bucket_bytes < 37 * 16 * dtype.itemsize:
        assert any(e.start > 0 for b in plan for e in b), "the embedding should have been split"


def test_groups_stay_in_one_bucket_when_they_fit():
    named = _named()
    bucket_bytes = 8192        # the attention group (~2.5 KiB) and the MLP group (~4.6 KiB) fit
    plan = plan_buckets(named_specs(named, torch.float32), bucket_bytes)
    where = {}
    for k, bucket in enumerate(plan):
        for e in bucket:
            where.setdefault(e.group, set()).add(k)
    assert all(len(ks) == 1 for ks in where.values()), where


def test_too_large_tensor_without_split_names_it():
    named = _named()
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight.*bucket_bytes=1024"):
        plan_buckets(named_specs(named, torch.float32), 1024, allow_split=False)


def test_bad_bucket_size_and_duplicate_names():
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", (4,), torch.float32)], 16)
    with pytest.raises(ValueError, match="repeated"):
        plan_buckets([("a", (4,), torch.float32), ("a", (4,), torch.float32)], 4096)


def test_check_names_lists_unknown_and_missing():
    with pytest.raises(ValueError, match=r"no parameters named \['model\.bogus\.weight'\]"):
        check_names(["model.norm.weight", "model.bogus.weight"], ["model.norm.weight"])
    with pytest.raises(ValueError, match=r"missing \['lm_head\.weight'\]"):
        check_names(["model.norm.weight"], ["model.norm.weight", "lm_head.weight"])


@pytest.mark.parametrize("n_buffers", [1, 2])
def test_sender_over_shared_memory_is_exact(n_buffers):
    named = _named(1)
    worker = FakeWorker()
    sender = BucketedSender(worker.rpc, ShmTransport(n_buffers), dtype=torch.bfloat16, bucket_bytes=512,
                            expected_names=[n for n, _ in named])
    try:
        stats = sender.sync(named)
        assert stats.buckets == len(sender._plan) > 10
        assert worker.calls.count("fastgrpo_attach") == 1
        for n, t in named:
            assert torch.equal(worker.loaded[n], t.to(torch.bfloat16)), n
        # second sync: the buffers are reused (no new attach) and new values arrive
        named2 = [(n, t * 2) for n, t in named]
        sender.sync(named2)
        assert worker.calls.count("fastgrpo_attach") == 1
        for n, t in named2:
            assert torch.equal(worker.loaded[n], t.to(torch.bfloat16)), n
        with pytest.raises(ValueError, match="no parameters named"):
            sender.sync(named + [("model.extra.weight", torch.zeros(2))])
    finally:
        sender.close()


def test_per_parameter_path_is_exact():
    named = _named(2)
    worker = FakeWorker()
    stats = sync_per_parameter(worker.rpc, named, torch.float32, [n for n, _ in named])
    assert stats.buckets == len(named)
    for n, t in named:
        assert torch.equal(worker.loaded[n], t), n


def test_direct_copy_weights():
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    stats = copy_weights(b, a.named_parameters())
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert stats.nbytes == (12 + 3) * 4
    with pytest.raises(ValueError, match=r"no parameters named \['other'\]"):
        copy_weights(b, list(a.named_parameters()) + [("other", torch.zeros(1))])


def test_failed_load_resets_the_engine_side():
    named = _named(3)
    worker = FakeWorker()
    calls = {"n": 0}

    def flaky(method, *args):
        if method == "fastgrpo_load_bucket":
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("engine died")
        return worker.rpc(method, *args)

    sender = BucketedSender(flaky, ShmTransport(), bucket_bytes=512)
    try:
        with pytest.raises(RuntimeError, match="engine died"):
            sender.sync(named)
        assert worker.receiver.incomplete() == []      # finish was called: nothing half-loaded
        with pytest.raises(ValueError, match="at least one"):
            sender.sync([])
        calls["n"] = -10**6
        sender.sync(named)
        for n, t in named:
            assert torch.equal(worker.loaded[n], t), n
    finally:
        sender.close()
