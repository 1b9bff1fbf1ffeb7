"""Weight broadcast from trainer rank 0 to remote rollout workers over a process group made for it.

Follows the weight-update groups of OpenRLHF / verl / AReaL (a communicator spanning the trainer's
rank 0 and every rollout worker, distinct from the trainer's own world): a *stateless* group —
a `torch.distributed.TCPStore` served by rank 0 and a `ProcessGroupGloo` (CPU) or
`ProcessGroupNCCL` (GPU) built on it directly, so it never touches `torch.distributed`'s default
group (the trainer's DDP / DeepSpeed world stays untouched, and a worker can be in both).

The payload is the bucketed plan of bucket.py (HF names, engine dtype, load groups kept
together), generic over any list of named tensors (full weights, a LoRA adapter's tensors). Two
buffers are in flight: rank 0 packs bucket k+1 while bucket k is on the wire, a receiver
unpacks bucket k while k+1 arrives (into a buffer per bucket, whose views it keeps: the staged
weights are the receiver's second copy, loaded between generate calls). Every sync is verified: `checksums` sums the bit patterns of
each tensor as integers (exact and order-free, so two processes with different thread counts
agree), the receiver returns them with the version it received, and `verify` names the first
tensor that differs; rank 0 also sends its own with the broadcast, and a receiver stages only
weights that match them (fastgrpo/workers/rollout_worker.py), so it never samples from a copy that
fails the check. Every collective waits at most `timeout` seconds and raises
`BroadcastError` naming the operation and bucket instead of hanging.

Workers on rank 0's node (sync.transport=auto on CPU, or shm) skip the group: rank 0 packs every
bucket into one shared-memory segment (`send_shm`) and each worker copies them out
(`ShmReceiver`) — a pack and a copy instead of gloo's socket round trips (SmolLM2-135M's 538 MB,
benchmarks/bench_broadcast.py: 0.15 s of rank 0's CPU instead of 0.64 s, 0.23 s a sync instead of
0.65 s). Either way the receivers' buffers are reused from one sync to the next
(`StagingBuffers`): a fresh buffer is fresh pages, and faulting 538 MB of them in cost a worker
0.35 s of its one core, more than the transfer.

Departures: vLLM's `StatelessProcessGroup.broadcast` (a store round trip per tensor, ~2 s each
on CPU) and `PyNcclCommunicator` (a no-op without CUDA) are not used; the group is plain c10d.
"""
from __future__ import annotations

import datetime
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from fastgrpo.sync.bucket import (ALIGN, BucketReceiver, TensorSlice, bucket_nbytes, named_specs, pack_bucket,
                                  plan_buckets)

Named = Sequence[Tuple[str, torch.Tensor]]


class BroadcastError(RuntimeError):
    """A collective of the weight-broadcast group failed or timed out."""


class SyncVerificationError(RuntimeError):
    """A receiver's loaded tensors differ from what rank 0 sent."""


class BroadcastGroup:
    """One member of a stateless broadcast group: rank 0 serves the store at host:port (the
    trainer), ranks 1.. connect to it (workers). Every member must construct it within
    `timeout` seconds of the others."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout: float, device: str = "cpu",
                 store=None):
        from torch import distributed as dist

        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.device = torch.device(device)
        td = datetime.timedelta(seconds=self.timeout)
        try:
            self.store = store if store is not None else dist.TCPStore(host, port, world_size, rank == 0, td,
                                                                       wait_for_workers=False)
            if self.device.type == "cuda":
                self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size)
            else:
                self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, td)
        except Exception as e:  # noqa: BLE001 — any failure to connect: one line naming the group
            raise BroadcastError(f"joining the weight-broadcast group at {host}:{port} as rank {rank}/{world_size} "
                                 f"failed within {self.timeout:g} s: {_first_line(e)}") from None

    @staticmethod
    def serve(host: str, world_size: int, timeout: float):
        """Rank 0's store on a free port of `host`: (store, port). Pass the store to rank 0's
        constructor and the port to the other members, then construct every member at once."""
        from torch import distributed as dist

        store = dist.TCPStore(host, 0, world_size, True, datetime.timedelta(seconds=float(timeout)),
                              wait_for_workers=False)
        return store, store.port

    def broadcast(self, tensor: torch.Tensor, what: str):
        """Start a broadcast from rank 0; returns the work handle (`wait(work, what)`)."""
        from torch import distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        try:
            return self.pg.broadcast([tensor], opts)
        except Exception as e:  # noqa: BLE001
            raise BroadcastError(f"{what}: {_first_line(e)}") from None

    def wait(self, work, what: str) -> None:
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 — gloo raises on timeout or a peer that went away
            raise BroadcastError(f"{what} failed or timed out after {self.timeout:g} s: {_first_line(e)}") from None
        if ok is False:
            raise BroadcastError(f"{what} timed out after {self.timeout:g} s")

    def close(self) -> None:
        self.pg = None
        self.store = None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class StagingBuffers:
    """Receive buffers reused from one sync to the next. A fresh 538 MB allocation is fresh pages:
    the first write faults every one of them in, which cost a worker more CPU (0.3–0.4 s on one
    core) than the transfer itself. `take` lends a buffer of exactly `nbytes` (a returned one when
    there is one), `give` returns them once the weights they hold are loaded or superseded."""

    def __init__(self):
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int, device=None) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                if device is None or buf.device == torch.device(device):
                    return buf
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, bufs: Sequence[torch.Tensor]) -> None:
        if any(b.is_cuda for b in bufs):  # copies out of them may still be queued on the stream
            torch.cuda.synchronize()
        with self._lock:  # no cap: never more than the most ever lent at once (staged + arriving + loading)
            for b in bufs:
                self._free.setdefault(b.numel(), []).append(b)


def plan(named: Named, bucket_bytes: int, dtype: Optional[torch.dtype] = None) -> List[List[tuple]]:
    """The bucket plan of `named` as plain tuples (sent to the receivers over RPC)."""
    return [[e.to_tuple() for e in b] for b in plan_buckets(named_specs(named, dtype), bucket_bytes)]


def send(group: BroadcastGroup, named: Named, buckets: List[List[tuple]], what: str = "weight broadcast") -> int:
    """Rank 0: pack and broadcast every bucket, two buffers in flight. Returns payload bytes."""
    tensors = dict(named)
    plan_ = [[TensorSlice.coerce(e) for e in b] for b in buckets]
    size = max((bucket_nbytes(b) for b in plan_), default=0)
    bufs = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(min(2, len(plan_)))]
    total = 0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgrpo-bcast-pack") as pool:
        packing = pool.submit(pack_bucket, bufs[0], plan_[0], tensors) if plan_ else None
        work = None
        for k, b in enumerate(plan_):
            packing.result()
            n = bucket_nbytes(b)
            if work is not None:
                group.wait(work, f"{what}, bucket {k - 1}/{len(plan_)}")
            work = group.broadcast(bufs[k % 2][:n], f"{what}, bucket {k}/{len(plan_)}")
            total += n
            if k + 1 < len(plan_):  # pack the next bucket into the other buffer while this one is sent
                packing = pool.submit(pack_bucket, bufs[(k + 1) % 2], plan_[k + 1], tensors)
        if work is not None:
            group.wait(work, f"{what}, bucket {len(plan_) - 1}/{len(plan_)}")
    return total


def _alloc(alloc, nbytes: int, device) -> torch.Tensor:
    return alloc(nbytes, device) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)


def receive(group: BroadcastGroup, buckets: List[List[tuple]], what: str = "weight broadcast",
            corrupt_bucket: Optional[int] = None, alloc=None) -> Dict[str, torch.Tensor]:
    """Ranks 1..: receive every bucket (the next one arrives while the last is unpacked) into
    tensors owned by the caller (views of buffers from `alloc(nbytes, device)`, e.g. a
    StagingBuffers' `take`; fresh ones without). `corrupt_bucket` flips bytes of that bucket after
    it arrived (fault injection for the verification's test)."""
    plan_ = [[TensorSlice.coerce(e) for e in b] for b in buckets]
    # a buffer per bucket: the staged tensors are views of it (no copy out), and bucket k + 1 is
    # on the wire while bucket k is unpacked
    bufs = [_alloc(alloc, bucket_nbytes(b), group.device) for b in plan_]
    recv = BucketReceiver()
    out: Dict[str, torch.Tensor] = {}
    works = {}
    if plan_:
        works[0] = group.broadcast(bufs[0], f"{what}, bucket 0/{len(plan_)}")
    for k, b in enumerate(plan_):
        group.wait(works.pop(k), f"{what}, bucket {k}/{len(plan_)}")
        if k + 1 < len(plan_):
            works[k + 1] = group.broadcast(bufs[k + 1], f"{what}, bucket {k + 1}/{len(plan_)}")
        buf = bufs[k]
        if corrupt_bucket == k:
            buf ^= 0x5A
        for name, t in recv.receive(buf, b):
            out[name] = t  # a view of this bucket's own buffer, never refilled
    missing = recv.incomplete()
    if missing:
        raise BroadcastError(f"{what}: tensors incomplete after the last bucket: {missing[:5]}")
    return out


def shm_layout(buckets: List[List[tuple]]) -> Tuple[List[int], int]:
    """(byte offset of each bucket, total bytes) of the buckets laid end to end in one segment."""
    plan_ = [[TensorSlice.coerce(e) for e in b] for b in buckets]
    offsets, total = [], 0
    for b in plan_:
        offsets.append(total)
        total += -(-bucket_nbytes(b) // ALIGN) * ALIGN
    return offsets, total


def send_shm(channel, named: Named, buckets: List[List[tuple]]) -> Dict:
    """Rank 0, every receiver on this node (sync.transport=shm): pack every bucket into one
    shared-memory segment (`fastgrpo.sync.shm.ShmTransport`, grown when needed) and return what
    the receivers attach to. The caller must not pack again before every receiver has returned
    (`ShmReceiver.receive` copies out of the segment before it does)."""
    tensors = dict(named)
    plan_ = [[TensorSlice.coerce(e) for e in b] for b in buckets]
    offsets, total = shm_layout(buckets)
    channel.ensure(max(total, 1))
    buf = channel.buffers[0]
    for off, b in zip(offsets, plan_):
        pack_bucket(buf[off:off + bucket_nbytes(b)], b, tensors)
    return dict(channel.payload(), offsets=offsets)


class ShmReceiver:
    """Ranks 1.. on rank 0's node: the segment of the last `send_shm`, mapped once (again when
    rank 0 grew it), copied out bucket by bucket into tensors the caller owns."""

    def __init__(self, track: bool = False):
        self.track = track  # True in rank 0's own process or its multiprocessing children (one resource tracker)
        self._names: Optional[tuple] = None
        self._buffers: List[torch.Tensor] = []
        self._handles: list = []

    def _map(self, payload: Dict) -> torch.Tensor:
        from fastgrpo.sync.shm import attach

        names = tuple(payload["names"])
        if names != self._names:
            self.close()
            self._buffers, self._handles = attach(payload, track=self.track)
            self._names = names
        return self._buffers[0]

    def receive(self, payload: Dict, buckets: List[List[tuple]], what: str = "weight broadcast",
                corrupt_bucket: Optional[int] = None, alloc=None) -> Dict[str, torch.Tensor]:
        """Every bucket copied out of the segment into buffers from `alloc` (as `receive`'s)."""
        try:
            seg = self._map(payload)
        except (OSError, ValueError) as e:
            raise BroadcastError(f"{what}: cannot map rank 0's shared memory {list(payload['names'])}: "
                                 f"{_first_line(e)} (a worker on another node needs sync.transport=group)") from None
        plan_ = [[TensorSlice.coerce(e) for e in b] for b in buckets]
        recv = BucketReceiver()
        out: Dict[str, torch.Tensor] = {}
        for k, (off, b) in enumerate(zip(payload["offsets"], plan_)):
            n = bucket_nbytes(b)
            buf = _alloc(alloc, n, None)
            buf.copy_(seg[off:off + n])  # ours: rank 0 packs the next sync into the segment
            if corrupt_bucket == k:
                buf ^= 0x5A
            for name, t in recv.receive(buf, b):
                out[name] = t
        missing = recv.incomplete()
        if missing:
            raise BroadcastError(f"{what}: tensors incomplete after the last bucket: {missing[:5]}")
        return out

    def close(self) -> None:
        self._buffers = []
        for h in self._handles:
            try:
                h.close()
            except BufferError:  # a view still alive: the mapping goes with it
                pass
        self._handles, self._names = [], None


def checksum(t: torch.Tensor) -> int:
    """Sum of the tensor's bytes read as 32-bit integers, wrapping: exact, independent of
    summation order and thread count (integer addition mod 2^32 is associative), changed by any
    single flipped element, and as fast as a float sum (9 ms for SmolLM2's 28M-element embedding
    on one core; widening to int64 in the reduction took 350 ms)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4:
        return int(raw.sum(dtype=torch.int64))
    return int(raw.view(torch.int32).sum(dtype=torch.int32)) if raw.numel() else 0


def checksums(named: Iterable[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None) -> Dict[str, int]:
    """Checksum of every tensor as the receivers hold it (cast to the engine dtype `dtype`)."""
    out = {}
    for n, t in named:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        out[n] = checksum(t)
    return out


def verify(expected: Dict[str, int], got: Dict[str, int], who: str, version: int, got_version: int) -> None:
    """Raise SyncVerificationError naming `who` and the first tensor whose checksum differs."""
    if got_version != version:
        raise SyncVerificationError(f"{who} loaded weights version {got_version}, expected {version}")
    for name, want in expected.items():
        if name not in got:
            raise SyncVerificationError(f"{who}: tensor {name!r} of version {version} never arrived")
        if got[name] != want:
            raise SyncVerificationError(f"{who}: tensor {name!r} of version {version} differs from the trainer's "
                                        f"(checksum {got[name]} vs {want}): the broadcast was corrupted")
