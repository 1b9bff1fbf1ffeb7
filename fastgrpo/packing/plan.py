"""The micro-batch planner: which sequences go into which token-budget micro-batch.

One function for both callers: `build_packed_batches` (one process, optionally at least m
micro-batches) and the trainer (data-parallel ranks, which must all run the same number of
micro-batches: ZeRO and DDP reduce gradients inside every backward, so a rank that ran fewer
would hang its peers).

Algorithm: first-fit-decreasing bins (`bins.pack_sequences`) over units — single sequences, or
whole groups cut into budget-sized runs so that a shared-prefix batch finds a group together.
When fewer bins than wanted come out, Karmarkar–Karp (`bins.balance_partitions`) splits the units
into the wanted count, as verl's dynamic batch size does; where that split breaks the budget,
ranks pad with empty micro-batches (run as zero-weighted dummies) and a single process tries
one more micro-batch at a time until every one fits.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import numpy as np

from fastgrpo.packing.bins import Workload, balance_partitions, is_int, pack_sequences, DEFAULT_ATTN_COEF


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, allow_oversize: bool = False,
                       groups: Optional[Sequence] = None, min_micro_batches: int = 1,
                       agree: Optional[Callable[[int], int]] = None, workload: Workload = "tokens",
                       attn_coef: float = DEFAULT_ATTN_COEF) -> List[List[int]]:
    """Sequence indices of each micro-batch (sorted within one).

    `lengths[i]`: tokens of sequence i. A sequence over `max_tokens` raises ValueError naming
    it, or gets a micro-batch of its own with `allow_oversize`.
    `groups` (a key per sequence, e.g. its prompt id): whole groups are packed together (cut into
    budget-sized runs when a group alone exceeds it).
    `min_micro_batches`: at least this many micro-batches (never an empty one; more sequences
    than that are needed).
    `agree`: across data-parallel ranks, maps this rank's micro-batch count to the count every
    rank runs (a max all-reduce, `fastgrpo.trainer.collectives.all_reduce_max`); exactly that
    many lists come back, empty ones where this rank has too few sequences.
    """
    if not is_int(min_micro_batches) or min_micro_batches < 1:
        raise ValueError(f"min_micro_batches={min_micro_batches!r}: expected an integer >= 1")
    if groups is not None and len(groups) != len(lengths):
        raise ValueError(f"groups: expected one key per sequence ({len(lengths)}), got {len(groups)}")
    lengths = [int(x) for x in lengths] if not isinstance(lengths, np.ndarray) else lengths.tolist()
    if groups is not None and lengths:
        if not allow_oversize:  # name the sequence itself, not the unit holding it
            pack_sequences(lengths, max_tokens)
        units = _group_units(lengths, groups, max_tokens)
    else:
        units = [[i] for i in range(len(lengths))]
    sizes = [sum(lengths[i] for i in u) for u in units]
    unit_bins = pack_sequences(sizes, max_tokens, allow_oversize=allow_oversize) if units else []
    want = max(len(unit_bins), int(min_micro_batches))
    if agree is not None:
        want = int(agree(want))
    elif want > len(units) and units:
        raise ValueError(f"min_micro_batches={min_micro_batches} > {len(units)} sequences: a micro-batch "
                         "cannot be empty")
    if want > len(unit_bins) and units:
        unit_bins = _split(sizes, max_tokens, want, unit_bins, pad=agree is not None, workload=workload,
                           attn_coef=attn_coef)
    bins = [sorted(i for k in b for i in units[k]) for b in unit_bins]
    return bins + [[] for _ in range(want - len(bins))] if agree is not None else bins


def _split(sizes: List[int], budget: int, want: int, ffd: List[List[int]], pad: bool, workload: Workload,
           attn_coef: float) -> List[List[int]]:
    """`want` Karmarkar–Karp parts of the units when they all fit the budget (an oversize unit
    alone is fine); else the FFD bins (padded by the caller) or, without padding, more parts."""
    arr = np.asarray(sizes, dtype=np.int64)
    for m in range(want, (want if pad else len(sizes)) + 1):
        if m > len(sizes):
            break
        parts = balance_partitions(arr, m, workload=workload, attn_coef=attn_coef)
        if len(parts) == m and all(parts) and all(len(p) == 1 or arr[p].sum() <= budget for p in parts):
            return parts
    if pad:
        return ffd
    # m = n puts one unit in each part (positive sizes never share a subset), so the loop
    # always returns; this line only guards that reasoning
    raise RuntimeError(f"no split of {len(sizes)} sequences fits max_tokens={budget}")


def _group_units(lengths: Sequence[int], groups: Sequence, max_tokens: int) -> List[List[int]]:
    """Sequence indices by group (first appearance order), each group cut into consecutive runs
    of at most `max_tokens` tokens (a sequence over the budget alone in its run)."""
    by_key: dict = {}
    for i, key in enumerate(groups):
        by_key.setdefault(key, []).append(i)
    units = []
    for members in by_key.values():
        run, total = [], 0
        for i in members:
            if run and total + lengths[i] > max_tokens:
                units.append(run)
                run, total = [], 0
            run.append(i)
            total += lengths[i]
        units.append(run)
    return units
