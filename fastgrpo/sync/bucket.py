"""Bucketed weight packing for trainer → rollout-engine sync.

Follows the bucketed update of verl / slime (one contiguous buffer per transfer instead of one
call per parameter, as TRL's colocated path does): parameters are cast to the engine dtype and
copied, under their Hugging Face names, into a reusable contiguous byte buffer; each bucket
carries a list of `TensorSlice` metadata `(name, dtype, shape, offset, ...)` so the receiver can
slice zero-copy views out of the same buffer.

Departures:
- Tensors are packed by *load group* (the HF parent module of a projection, e.g.
  `model.layers.3.self_attn`): vLLM fuses q/k/v and gate/up into one layer and its in-place
  `reload_weights` processes a layer only once every piece of it has arrived, so a group is kept
  inside one bucket whenever it fits. A group that does not fit (or a tensor split across
  buckets) is held by the receiver until complete; only those pieces are copied.
- A tensor larger than a bucket is split across buckets by flat element range (or, with
  `allow_split=False`, rejected with the sizes that would make it fit).
- Tied parameters (the same tensor under two names) are sent once, under the first name:
  `named_parameters()` already removes duplicates, and engines that tie (vLLM's lm_head) skip
  the second name when loading.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch

# Offsets are aligned to 256 bytes: enough for any dtype view and for vectorised copies.
ALIGN = 256
DEFAULT_BUCKET_BYTES = 1 << 30

_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float32, torch.float16, torch.bfloat16,
                                                     torch.float64, torch.int64, torch.int32,
                                                     torch.int8, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise ValueError(f"dtype={dtype}: expected one of {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_group(name: str) -> str:
    """HF parent-of-parent module for projections (`model.layers.0.self_attn.q_proj.weight` →
    `model.layers.0.self_attn`), the parent module for shorter names (`model.norm.weight` →
    `model.norm`). A superset of every fused vLLM layer in the Llama / Qwen / Mistral families."""
    parts = name.split(".")
    keep = len(parts) - 2 if len(parts) >= 5 else len(parts) - 1
    return ".".join(parts[:max(keep, 1)])


@dataclass(frozen=True)
class TensorSlice:
    """One (piece of a) tensor inside a bucket. `start`/`numel` are flat element indices into
    the full tensor; a whole tensor has start=0 and numel == prod(shape)."""
    name: str            # Hugging Face parameter name
    dtype: str           # engine dtype, e.g. "bfloat16"
    shape: Tuple[int, ...]  # full tensor shape
    offset: int          # byte offset into the bucket buffer
    start: int           # first flat element of this piece
    numel: int           # elements in this piece
    group: str           # load group (see load_group)
    group_size: int      # number of tensors in the group

    def to_tuple(self) -> tuple:
        """Plain-data form for RPCs that do not pickle (vLLM's msgpack between processes)."""
        return (self.name, self.dtype, list(self.shape), self.offset, self.start, self.numel, self.group,
                self.group_size)

    @classmethod
    def coerce(cls, e) -> "TensorSlice":
        if isinstance(e, cls):
            return e
        name, dtype, shape, offset, start, numel, group, group_size = e
        return cls(name, dtype, tuple(int(s) for s in shape), int(offset), int(start), int(numel), group,
                   int(group_size))

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize

    @property
    def total(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _align(x: int) -> int:
    return (x + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 allow_split: bool = True) -> List[List[TensorSlice]]:
    """Assign each (name, shape, engine dtype) to buckets of at most `bucket_bytes` bytes."""
    if not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: expected an integer >= {ALIGN}")
    names = [s[0] for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique; repeated: {dup}")
    group_size: Dict[str, int] = {}
    group_bytes: Dict[str, int] = {}
    for name, shape, dtype in specs:
        g = load_group(name)
        group_size[g] = group_size.get(g, 0) + 1
        group_bytes[g] = group_bytes.get(g, 0) + _align(_numel(shape) * dtype.itemsize)

    buckets: List[List[TensorSlice]] = [[]]
    used = 0
    prev_group = None
    for name, shape, dtype in specs:
        g = load_group(name)
        itemsize = dtype.itemsize
        total = _numel(shape)
        nbytes = total * itemsize
        if g != prev_group and used > 0 and used + group_bytes[g] > bucket_bytes >= group_bytes[g]:
            buckets.append([])          # keep the whole group in one bucket
            used = 0
        prev_group = g
        if nbytes > bucket_bytes and not allow_split:
            raise ValueError(f"parameter {name!r} has {nbytes} bytes ({tuple(shape)} {dtype}), more than "
                             f"bucket_bytes={bucket_bytes}; raise bucket_bytes to >= {_align(nbytes)} or "
                             f"pass allow_split=True")
        if nbytes <= bucket_bytes and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        start = 0
        while start < total or total == 0:
            room = (bucket_bytes - used) // itemsize
            if room == 0:
                buckets.append([])
                used = 0
                continue
            take = min(room, total - start)
            buckets[-1].append(TensorSlice(name, dtype_name(dtype), tuple(int(s) for s in shape), used, start,
                                           take, g, group_size[g]))
            used = min(_align(used + take * itemsize), bucket_bytes)
            start += take
            if total == 0:
                break
    return [b for b in buckets if b]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def bucket_nbytes(bucket: Sequence[TensorSlice]) -> int:
    return max((e.offset + e.nbytes for e in bucket), default=0)


def pack_bucket(buffer: torch.Tensor, bucket: Sequence[TensorSlice], tensors: Dict[str, torch.Tensor]) -> None:
    """Copy (and cast) each slice of `bucket` from `tensors` into the uint8 `buffer`."""
    for e in bucket:
        src = tensors[e.name].detach()
        flat = src.reshape(-1) if src.is_contiguous() else src.contiguous().reshape(-1)
        dst = buffer[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype))
        dst.copy_(flat[e.start:e.start + e.numel], non_blocking=True)


class BucketReceiver:
    """Engine-side unpacking: views of the bucket buffer for whole tensors of complete groups;
    split tensors and groups that straddle buckets are copied out and held until complete."""

    def __init__(self):
        self._partial: Dict[str, torch.Tensor] = {}
        self._pending: Dict[str, List[Tuple[str, torch.Tensor]]] = {}

    def receive(self, buffer: torch.Tensor, bucket: Iterable[TensorSlice]) -> List[Tuple[str, torch.Tensor]]:
        """Tensors of every group completed by this bucket. Views into `buffer` are valid only
        until the buffer is refilled: load them before the next bucket arrives."""
        ready: List[Tuple[str, torch.Tensor]] = []
        in_buffer = set()
        for e in map(TensorSlice.coerce, bucket):
            view = buffer[e.offset:e.offset + e.nbytes].view(dtype_from_name(e.dtype))
            if e.start == 0 and e.numel == e.total:
                t = view.view(e.shape)
                in_buffer.add(e.name)
            else:
                acc = self._partial.get(e.name)
                if acc is None:
                    acc = self._partial[e.name] = torch.empty(e.total, dtype=view.dtype, device=view.device)
                acc[e.start:e.start + e.numel].copy_(view)
                if e.start + e.numel < e.total:
                    continue
                t = self._partial.pop(e.name).view(e.shape)
            self._add(e.group, e.group_size, e.name, t, ready)
        for g, items in self._pending.items():
            # these wait for a later bucket: detach them from the buffer that is about to be reused
            self._pending[g] = [(n, t.clone() if n in in_buffer else t) for n, t in items]
        return ready

    def receive_named(self, items: Iterable[Tuple[str, torch.Tensor, str, int]]) -> List[Tuple[str, torch.Tensor]]:
        """Per-parameter path: (name, tensor, group, group_size) tuples owned by the caller."""
        ready: List[Tuple[str, torch.Tensor]] = []
        for name, t, g, size in items:
            self._add(g, size, name, t, ready)
        return ready

    def _add(self, group: str, size: int, name: str, t: torch.Tensor, ready: list) -> None:
        items = self._pending.setdefault(group, [])
        items.append((name, t))
        if len(items) == size:
            ready.extend(self._pending.pop(group))

    def incomplete(self) -> List[str]:
        """Names still waiting for the rest of their tensor or group (empty after a full sync)."""
        names = sorted(self._partial)
        for items in self._pending.values():
            names.extend(n for n, _ in items)
        return names

    def reset(self) -> None:
        self._partial.clear()
        self._pending.clear()


def named_specs(named: Sequence[Tuple[str, torch.Tensor]], dtype: Optional[torch.dtype]) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    """(name, shape, engine dtype) of each tensor; dtype None keeps each tensor's own dtype."""
    return [(n, tuple(t.shape), dtype if dtype is not None and t.is_floating_point() else t.dtype) for n, t in named]
