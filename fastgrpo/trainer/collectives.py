"""Data movement of data-parallel GRPO: prompt shards, rollout rebalancing across ranks
(Karmarkar–Karp, verl's `seqlen_balancing`), small all-gathers, metric reduction and the max
that makes every rank plan the same number of micro-batches (`fastgrpo.packing.plan`).

Every function is a no-op pass-through in a single process, so the trainer calls them
unconditionally.
"""
from __future__ import annotations

import zlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

REDUCE_OPS = ("mean", "sum", "max", "min")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ---------------------------------------------------------------------------------------------

def shard(items: Sequence, rank_: Optional[int] = None, world: Optional[int] = None) -> List:
    """This rank's contiguous share of `items` (e.g. prompts; each prompt's G samples are then
    generated on one rank by its colocated engine, so group statistics need no communication).
    Shares differ in size by at most one."""
    r = _rank() if rank_ is None else rank_
    w = _world() if world is None else world
    n = len(items)
    lo, hi = n * r // w, n * (r + 1) // w
    return list(items[lo:hi])


def rebalance(items: Sequence, lengths: Sequence[int], workload: Any = "tokens") -> List:
    """Redistribute rollout records so that every rank holds the same number of sequences and a
    near-equal workload (Karmarkar–Karp over the lengths of all ranks' sequences).

    `items[i]` is any picklable record of sequence i (token ids, advantage, old log-probs …),
    `lengths[i]` its token count. Each record travels once (one scatter per source rank), so the
    traffic is the batch itself, not world × batch. Returns this rank's records in a
    deterministic order (by source rank, then source index). Every rank must call it.
    """
    from fastgrpo.packing import balance_partitions

    if len(items) != len(lengths):
        raise ValueError(f"lengths: expected {len(items)} entries (one per item), got {len(lengths)}")
    w = _world()
    if w == 1:
        return list(items)
    per_rank: List[List[int]] = [None] * w  # type: ignore[list-item]
    dist.all_gather_object(per_rank, [int(x) for x in lengths])
    flat = [(src, i) for src in range(w) for i in range(len(per_rank[src]))]
    all_lengths = [per_rank[src][i] for src, i in flat]
    parts = balance_partitions(all_lengths, w, equal_size=True, workload=workload) if flat else []
    parts = list(parts) + [[] for _ in range(w - len(parts))]
    dest_of = {}
    for d, part in enumerate(parts):
        for g in part:
            dest_of[flat[g]] = d
    me = _rank()
    received: List = []
    for src in range(w):
        out: List[Any] = [None]
        send = None
        if src == me:
            send = [[(i, items[i]) for i in range(len(items)) if dest_of[(me, i)] == d] for d in range(w)]
        dist.scatter_object_list(out, send, src=src)
        received.extend(item for _, item in sorted(out[0], key=lambda t: t[0]))
    return received


def all_gather(obj: Any) -> List[Any]:
    """[obj of rank 0, obj of rank 1, …] on every rank (picklable objects; [obj] alone). For
    small per-step state every rank must agree on, e.g. curriculum updates (prompt ids and
    pass/fail of every rank's rollouts) so that the shared-seed samplers stay identical."""
    if _world() == 1:
        return [obj]
    out: List[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(value: int) -> int:
    """The maximum of an integer over ranks (itself in one process); e.g. the micro-batch count
    every rank runs (`fastgrpo.packing.plan_micro_batches(agree=all_reduce_max)`)."""
    if _world() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _keys_crc(keys: Sequence[str]) -> float:
    return float(zlib.crc32("\x00".join(keys).encode()) % (1 << 24))  # exact in float64


def all_reduce_metrics(metrics: Mapping[str, float], op: str = "mean",
                       ops: Optional[Mapping[str, str]] = None) -> Dict[str, float]:
    """Reduce scalar metrics over ranks with one collective per reduction kind.

    `op` is the default ("mean", "sum", "max", "min"); `ops` overrides it per key (e.g.
    {"completion/max_length": "max"}). Every rank must pass the same keys; a mismatch raises
    ValueError instead of silently mixing metrics.
    """
    for name, o in [("op", op)] + [(f"ops[{k!r}]", v) for k, v in (ops or {}).items()]:
        if o not in REDUCE_OPS:
            raise ValueError(f"{name}={o!r}: expected one of {REDUCE_OPS}")
    out = {k: float(v) for k, v in metrics.items()}
    if _world() == 1:
        return out
    kinds: Dict[str, List[str]] = {}
    for k in sorted(out):
        kinds.setdefault((ops or {}).get(k, op), []).append(k)
    for kind in REDUCE_OPS:  # fixed order: every rank issues the same collectives
        keys = kinds.get(kind, [])
        t = torch.tensor([out[k] for k in keys] + [_keys_crc(keys)], dtype=torch.float64)
        red = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[kind]
        crc = t[-1].item()
        check = torch.tensor([crc, -crc], dtype=torch.float64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        if check[0].item() != crc or -check[1].item() != crc:
            raise ValueError(f"metrics: ranks passed different keys for op={kind!r} (rank {_rank()}: {keys})")
        dist.all_reduce(t, op=red)
        vals = t[:-1] / _world() if kind == "mean" else t[:-1]
        out.update({k: float(v) for k, v in zip(keys, vals.tolist())})
    return out
