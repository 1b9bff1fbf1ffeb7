"""Sequence packing: token-budget micro-batches, balanced partitions, and the packed layout.

Algorithms (each in C++ in csrc/packing.cpp with a pure-Python twin in fastgrpo/packing/bins_py.py
making the same decisions in the same order, so both backends return identical results):

- `pack_sequences`: first-fit-decreasing bin packing (Johnson 1973) of sequence lengths into
  bins of `max_tokens`; the first bin with room is found with a max segment tree over remaining
  capacities, O(n log n). FFD uses at most 11/9·OPT + 6/9 bins.
- `balance_partitions`: Karmarkar–Karp largest differencing method, k-way (Korf 2009), with an
  equal-size variant in the spirit of verl's `seqlen_balancing` (departure: sizes may differ by
  one instead of requiring n % k == 0). The final max − min load never exceeds the largest
  single workload, since merging a descending with an ascending partial solution never widens
  the spread beyond the wider of the two.
- `build_cu_seqlens` / `build_position_ids`: the varlen-attention layout (flash-attn
  `cu_seqlens`, positions restarting at 0 for each sequence).

The packed layout built on these bins is `fastgrpo.packing.layout`; the micro-batch planner is
`fastgrpo.packing.plan`. The `_py` / `_c` functions pick a backend explicitly (same input
checks); the unsuffixed ones take C++ when it is built (fastgrpo/native/ext.py).
"""
from __future__ import annotations

import math
import operator
from typing import Callable, List, Sequence, Union

import numpy as np
import torch

from fastgrpo.native import ext as _cext
from fastgrpo.packing.bins_py import balance_kk_py, cu_seqlens_py, pack_ffd_py, position_ids_py

__all__ = ["pack_sequences", "pack_sequences_py", "pack_sequences_c", "balance_partitions",
           "balance_partitions_py", "balance_partitions_c", "partition_loads", "build_cu_seqlens",
           "build_cu_seqlens_py", "build_cu_seqlens_c", "build_position_ids", "build_position_ids_py",
           "build_position_ids_c", "check_budget", "is_int"]

# Default `a` of the attention workload a·L + L²: per token, the dense layers of a transformer cost
# ~24·d² FLOPs and attention ~4·d·L, so cost ∝ 6·d·L + L²; 6·4096 fits a 7B-class model (d = 4096).
DEFAULT_ATTN_COEF = 6 * 4096


# input checks

def _as_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """Validate a 1-D collection of non-negative integers; return it as int64 numpy."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.detach().cpu().numpy()
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D sequence of integers, got shape {lengths.shape}")
        if lengths.size and not np.issubdtype(lengths.dtype, np.integer):
            raise ValueError(f"{name}: expected integer lengths, got dtype {lengths.dtype}")
        arr = lengths.astype(np.int64, copy=False)
    else:
        try:
            # operator.index rejects floats (3.0 included) and strings: lengths are token counts.
            arr = np.fromiter((operator.index(x) for x in lengths), dtype=np.int64)
        except TypeError:
            bad = next((x for x in lengths if not is_int(x)), None)
            raise ValueError(f"{name}: expected non-negative integers, got {bad!r}") from None
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"{name}[{i}] = {int(arr[i])}: expected a non-negative integer")
    return np.ascontiguousarray(arr)


def is_int(x) -> bool:
    try:
        operator.index(x)
        return not isinstance(x, bool)
    except TypeError:
        return False


def check_budget(max_tokens) -> int:
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}: expected an integer >= 1")
    return int(max_tokens)


def _check_oversize(arr: np.ndarray, max_tokens: int, allow_oversize: bool) -> None:
    if allow_oversize or arr.size == 0:
        return
    over = np.nonzero(arr > max_tokens)[0]
    if over.size:
        i = int(over[0])
        raise ValueError(f"sequence {i} has length {int(arr[i])} > max_tokens={max_tokens} "
                         f"({over.size} over budget); raise the budget or pass allow_oversize=True "
                         "to give each its own bin")


def _backend_c():
    if _cext.C is None:
        raise ValueError("the C++ extension fastgrpo._C is not available (not built, or "
                         "FASTGRPO_DISABLE_EXT=1); use the _py variant")
    return _cext.C


# first-fit-decreasing packing

def pack_sequences_py(lengths, max_tokens: int, allow_oversize: bool = False) -> List[List[int]]:
    """Pure-Python `pack_sequences` (same bins, same order as the C++ one)."""
    arr = _as_lengths(lengths)
    budget = check_budget(max_tokens)
    _check_oversize(arr, budget, allow_oversize)
    return pack_ffd_py(arr.tolist(), budget)  # oversize ones were checked above


def pack_sequences_c(lengths, max_tokens: int, allow_oversize: bool = False) -> List[List[int]]:
    """C++ `pack_sequences` (fastgrpo._C.pack_ffd)."""
    C = _backend_c()
    arr = _as_lengths(lengths)
    budget = check_budget(max_tokens)
    _check_oversize(arr, budget, allow_oversize)
    return C.pack_ffd(arr, budget, allow_oversize)


def pack_sequences(lengths, max_tokens: int, allow_oversize: bool = False) -> List[List[int]]:
    """First-fit-decreasing packing of `lengths` into bins holding at most `max_tokens` tokens.

    Returns the sequence indices of each bin (bins in opening order, indices in placement order:
    longest first, ties by index). A sequence longer than `max_tokens` raises ValueError naming
    it, or gets a bin of its own when `allow_oversize=True`. Empty input gives `[]`.
    Uses the C++ extension when built, else the Python twin.
    """
    if _cext.C is not None:
        return pack_sequences_c(lengths, max_tokens, allow_oversize)
    return pack_sequences_py(lengths, max_tokens, allow_oversize)


# Karmarkar–Karp balancing

Workload = Union[str, Callable[[int], float]]


def _workloads(arr: np.ndarray, workload: Workload, attn_coef: float) -> np.ndarray:
    if callable(workload):
        w = np.fromiter((float(workload(int(x))) for x in arr), dtype=np.float64, count=arr.size)
    elif workload == "tokens":
        w = arr.astype(np.float64)
    elif workload == "attention":
        if not (isinstance(attn_coef, (int, float)) and math.isfinite(attn_coef) and attn_coef >= 0):
            raise ValueError(f"attn_coef={attn_coef!r}: expected a finite number >= 0")
        L = arr.astype(np.float64)
        w = float(attn_coef) * L + L * L
    else:
        raise ValueError(f"workload={workload!r}: expected 'tokens', 'attention' or a callable length -> cost")
    if w.size and not (np.isfinite(w).all() and (w >= 0).all()):
        i = int(np.nonzero(~(np.isfinite(w) & (w >= 0)))[0][0])
        raise ValueError(f"workload of sequence {i} (length {int(arr[i])}) is {w[i]!r}: expected finite and >= 0")
    return np.ascontiguousarray(w)


def _check_k(k) -> int:
    if not is_int(k) or k < 1:
        raise ValueError(f"k={k!r}: expected an integer >= 1 (number of partitions)")
    return int(k)


def balance_partitions_py(lengths, k: int, equal_size: bool = False, workload: Workload = "tokens",
                          attn_coef: float = DEFAULT_ATTN_COEF) -> List[List[int]]:
    """Pure-Python `balance_partitions` (identical result to the C++ one)."""
    arr = _as_lengths(lengths)
    k = _check_k(k)
    if arr.size == 0:
        return []
    return balance_kk_py(_workloads(arr, workload, attn_coef).tolist(), k, bool(equal_size))


def balance_partitions_c(lengths, k: int, equal_size: bool = False, workload: Workload = "tokens",
                         attn_coef: float = DEFAULT_ATTN_COEF) -> List[List[int]]:
    """C++ `balance_partitions` (fastgrpo._C.balance_kk)."""
    C = _backend_c()
    arr = _as_lengths(lengths)
    k = _check_k(k)
    if arr.size == 0:
        return []
    return C.balance_kk(_workloads(arr, workload, attn_coef), k, bool(equal_size))


def balance_partitions(lengths, k: int, equal_size: bool = False, workload: Workload = "tokens",
                       attn_coef: float = DEFAULT_ATTN_COEF) -> List[List[int]]:
    """Split sequence indices into `k` partitions of near-equal total workload (Karmarkar–Karp).

    `workload`: "tokens" (cost = L), "attention" (cost = attn_coef·L + L², the dense-layer plus
    quadratic attention cost; attn_coef ≈ 6·hidden_size) or a callable `length -> cost`.
    `equal_size=True` also makes the partition sizes differ by at most one (e.g. the same number
    of sequences per data-parallel rank). Returns k lists of sorted indices (some may be empty
    when there are fewer sequences than k); empty input gives `[]`.
    """
    if _cext.C is not None:
        return balance_partitions_c(lengths, k, equal_size, workload, attn_coef)
    return balance_partitions_py(lengths, k, equal_size, workload, attn_coef)


def partition_loads(lengths, partitions: Sequence[Sequence[int]], workload: Workload = "tokens",
                    attn_coef: float = DEFAULT_ATTN_COEF) -> List[float]:
    """Total workload of each partition (for balance metrics such as max/mean)."""
    w = _workloads(_as_lengths(lengths), workload, attn_coef)
    return [float(w[list(p)].sum()) if len(p) else 0.0 for p in partitions]


# varlen layout builders

def build_cu_seqlens_py(lengths) -> torch.Tensor:
    """Pure-Python `build_cu_seqlens`."""
    return torch.from_numpy(cu_seqlens_py(_as_lengths(lengths)))


def build_cu_seqlens_c(lengths) -> torch.Tensor:
    """C++ `build_cu_seqlens`."""
    return torch.from_numpy(_backend_c().cu_seqlens(_as_lengths(lengths)))


def build_cu_seqlens(lengths) -> torch.Tensor:
    """int32 `[n + 1]` prefix sums `[0, L0, L0+L1, …]` (flash-attn varlen `cu_seqlens`)."""
    return build_cu_seqlens_c(lengths) if _cext.C is not None else build_cu_seqlens_py(lengths)


def build_position_ids_py(lengths) -> torch.Tensor:
    """Pure-Python `build_position_ids`."""
    return torch.from_numpy(position_ids_py(_as_lengths(lengths)))


def build_position_ids_c(lengths) -> torch.Tensor:
    """C++ `build_position_ids`."""
    return torch.from_numpy(_backend_c().position_ids(_as_lengths(lengths)))


def build_position_ids(lengths) -> torch.Tensor:
    """int64 `[sum(lengths)]` positions `0..L-1` restarting at each sequence."""
    return build_position_ids_c(lengths) if _cext.C is not None else build_position_ids_py(lengths)
