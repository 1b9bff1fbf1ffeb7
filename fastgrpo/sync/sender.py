"""Trainer side of the bucketed weight sync: plan, pack, send, with two buffers in flight.

Follows verl's / slime's bucketed colocated update: the parameters (HF names, cast to the engine
dtype, tied weights once) are planned into buckets (bucket.py); bucket k+1 is packed on a helper
thread into the other buffer while the engine loads bucket k (copies release the GIL, so the two
overlap on CPU as on GPU). `rpc(method, *args)` reaches the engine's worker extension
(worker_ext.py); the engine resets its prefix cache after `sync` returns. The buffers are
attached once and their names removed right after (shm.py: nothing outlives a killed process).

`sync_per_parameter` is the baseline the bucketed path is measured against: one engine call per
parameter, as TRL's colocated vLLM sync does.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from fastgrpo.sync.bucket import (DEFAULT_BUCKET_BYTES, bucket_nbytes, dtype_name, load_group, named_specs,
                                  pack_bucket, plan_buckets)

Rpc = Callable[..., object]


@dataclass
class SyncStats:
    seconds: float   # wall time of the whole sync, engine load included
    nbytes: int      # payload bytes sent (engine dtype)
    buckets: int     # engine calls


def check_names(names: Sequence[str], expected: Optional[Iterable[str]]) -> None:
    """Unknown names or missing ones (a partial update would leave fused layers half-loaded)."""
    if expected is None:
        return
    expected = set(expected)
    unknown = sorted(set(names) - expected)
    if unknown:
        raise ValueError(f"the engine has no parameters named {unknown}; it knows {len(expected)} names, e.g. "
                         f"{sorted(expected)[:5]}")
    missing = sorted(expected - set(names))
    if missing:
        raise ValueError(f"a sync must send every engine parameter; missing {missing}")


class BucketedSender:
    def __init__(self, rpc: Rpc, transport, dtype: Optional[torch.dtype] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, allow_split: bool = True,
                 expected_names: Optional[Iterable[str]] = None):
        self.rpc = rpc
        self.transport = transport
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.allow_split = allow_split
        self.expected_names = set(expected_names) if expected_names is not None else None
        self._plan_key = None
        self._plan: List = []
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgrpo-pack")

    def plan(self, named: Sequence[Tuple[str, torch.Tensor]]):
        specs = named_specs(named, self.dtype)
        key = (tuple((n, s, d) for n, s, d in specs), self.bucket_bytes, self.allow_split)
        if key != self._plan_key:
            check_names([n for n, _ in named], self.expected_names)
            self._plan = plan_buckets(specs, self.bucket_bytes, self.allow_split)
            self._plan_key = key
        return self._plan

    def sync(self, named: Iterable[Tuple[str, torch.Tensor]]) -> SyncStats:
        t0 = time.perf_counter()
        named = list(named)
        if not named:
            raise ValueError("named: expected at least one (name, tensor) pair to sync")
        plan = self.plan(named)
        tensors: Dict[str, torch.Tensor] = dict(named)
        if self.transport.ensure(max(bucket_nbytes(b) for b in plan)):
            try:
                self.rpc("fastgrpo_attach", self.transport.payload())
            except BaseException:
                self.transport.close()  # the next sync allocates and attaches again
                raise
            # every engine worker has mapped the buffers: their names go (shared memory: nothing
            # left in /dev/shm however this process or the engine's ends; shm.py)
            unlink = getattr(self.transport, "unlink", None)
            if unlink is not None:
                unlink()
        bufs = self.transport.buffers
        sync_dev = _device_sync(bufs[0])
        try:
            # pack bucket 0 now, then keep the next bucket packing on the helper thread
            pack_bucket(bufs[0], plan[0], tensors)
            sync_dev()
            for k, bucket in enumerate(plan):
                nxt = None
                if k + 1 < len(plan) and len(bufs) > 1:
                    nxt = self._pool.submit(_pack_and_wait, bufs[(k + 1) % 2], plan[k + 1], tensors, sync_dev)
                try:
                    self.rpc("fastgrpo_load_bucket", k % len(bufs), [e.to_tuple() for e in bucket])
                finally:
                    if nxt is not None:
                        nxt.result()         # never leave a pack running into a buffer
                if nxt is None and k + 1 < len(plan):
                    pack_bucket(bufs[0], plan[k + 1], tensors)
                    sync_dev()
        except BaseException:
            self.rpc("fastgrpo_finish")      # drop the engine's half-received tensors
            raise
        left = self.rpc("fastgrpo_finish")
        if left:
            raise RuntimeError(f"weight sync ended with incomplete tensors on the engine: {left}")
        nbytes = sum(e.nbytes for b in plan for e in b)
        return SyncStats(time.perf_counter() - t0, nbytes, len(plan))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.transport.close()


def _pack_and_wait(buf, bucket, tensors, sync_dev):
    pack_bucket(buf, bucket, tensors)
    sync_dev()


def _device_sync(buf: torch.Tensor):
    if buf.is_cuda:
        return lambda: torch.cuda.current_stream(buf.device).synchronize()
    return lambda: None


def sync_by_reference(rpc: Rpc, named: Iterable[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None,
                      bucket_bytes: int = DEFAULT_BUCKET_BYTES, expected_names: Optional[Iterable[str]] = None
                      ) -> SyncStats:
    """Zero-copy buckets for an engine in this very process: the same group-aware bucket plan,
    but each call carries references to the trainer's tensors (cast only when the engine dtype
    differs) instead of a packed buffer. Not usable across processes."""
    t0 = time.perf_counter()
    named = [(n, t.detach()) for n, t in named]
    check_names([n for n, _ in named], expected_names)
    plan = plan_buckets(named_specs(named, dtype), bucket_bytes)
    tensors = dict(named)
    sizes: Dict[str, int] = {}
    for n, _ in named:
        sizes[load_group(n)] = sizes.get(load_group(n), 0) + 1
    nbytes, sent = 0, set()
    for bucket in plan:
        items = []
        for e in bucket:
            if e.name in sent:          # a split tensor travels whole, with its first piece
                continue
            sent.add(e.name)
            t = tensors[e.name]
            t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
            nbytes += t.numel() * t.element_size()
            items.append((e.name, t, e.group, e.group_size))
        if items:
            rpc("fastgrpo_load_named", items)
    left = rpc("fastgrpo_finish")
    if left:
        raise RuntimeError(f"weight sync ended with incomplete tensors on the engine: {left}")
    return SyncStats(time.perf_counter() - t0, nbytes, len(plan))


def merge_worker_results(method: str, results: Sequence) -> object:
    """The one result of an RPC sent to every engine worker (one per tensor-parallel rank): each
    loads its own shard of every bucket, so all must answer the same (tensor counts, names left
    incomplete); keeping worker 0's answer alone would hide a worker that failed to load."""
    results = list(results)
    if not results:
        raise RuntimeError(f"{method}: no engine worker answered")
    for i, r in enumerate(results[1:], 1):
        if r != results[0]:
            raise RuntimeError(f"{method}: engine workers disagree: worker 0 returned {results[0]!r}, worker {i} "
                               f"returned {r!r} (every tensor-parallel worker must load every bucket)")
    return results[0]


def sync_per_parameter(rpc: Rpc, named: Iterable[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None,
                       expected_names: Optional[Iterable[str]] = None, by_value: bool = False) -> SyncStats:
    """One engine call per parameter (TRL's colocated path); the benchmark baseline. `by_value`
    sends each tensor's bytes through the RPC, for an engine in another process (vLLM's msgpack
    RPC cannot carry a tensor nested in the arguments)."""
    t0 = time.perf_counter()
    named = list(named)
    check_names([n for n, _ in named], expected_names)
    sizes: Dict[str, int] = {}
    for n, _ in named:
        sizes[load_group(n)] = sizes.get(load_group(n), 0) + 1
    nbytes = 0
    for n, t in named:
        t = t.detach()
        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        nbytes += t.numel() * t.element_size()
        # bytes on the host: a CUDA (or any non-CPU) tensor is copied down first (.numpy() refuses it)
        payload = (dtype_name(t.dtype), list(t.shape),
                   t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()) if by_value else t
        rpc("fastgrpo_load_named", [(n, payload, load_group(n), sizes[load_group(n)])])
    left = rpc("fastgrpo_finish")
    if left:
        raise RuntimeError(f"weight sync ended with incomplete tensors on the engine: {left}")
    return SyncStats(time.perf_counter() - t0, nbytes, len(named))
