"""Pure-Python twins of csrc/packing.cpp (used when fastgrpo._C is absent, and by the tests as
the second backend). They take already-validated input (fastgrpo/packing/bins.py checks it) and make
the same decisions in the same order as the C++ code: same sort keys and tie-breaks, same heap
keys, same merge order, so both return identical results.

Algorithms: first-fit-decreasing with a max segment tree over remaining bin capacities
(Johnson 1973); Karmarkar–Karp k-way largest differencing (Korf 2009), equal-size variant after
verl's seqlen_balancing, padded with zero-weight dummies so that n need not divide by k.
"""
from __future__ import annotations

import heapq
from typing import List

import numpy as np


def pack_ffd_py(lengths: List[int], max_tokens: int) -> List[List[int]]:
    """FFD of validated lengths; a length > max_tokens gets a closed bin of its own."""
    n = len(lengths)
    size = 1
    while size < max(n, 1):
        size <<= 1
    # Unopened bins hold the full budget, so the leftmost leaf with room is either an open bin
    # with room or the next bin to open: one descent answers both questions.
    tree = [max_tokens] * (2 * size)
    order = sorted(range(n), key=lambda i: -lengths[i])  # stable: ties keep index order
    bins: List[List[int]] = []

    def set_leaf(leaf: int, value: int) -> None:
        node = size + leaf
        tree[node] = value
        node >>= 1
        while node:
            a, b = tree[2 * node], tree[2 * node + 1]
            tree[node] = a if a > b else b
            node >>= 1

    for idx in order:
        L = lengths[idx]
        if L > max_tokens:
            set_leaf(len(bins), -1)  # closed: nothing joins an over-budget sequence
            bins.append([idx])
            continue
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= L else 2 * node + 1
        b = node - size
        if b == len(bins):
            bins.append([])
        bins[b].append(idx)
        set_leaf(b, tree[node] - L)
    return bins


def balance_kk_py(weights: List[float], k: int, equal_size: bool) -> List[List[int]]:
    """Karmarkar–Karp k-way differencing over validated float workloads; k sorted index lists."""
    n = len(weights)
    states = []  # (sums, members)
    if equal_size:
        pad = (k - n % k) % k
        # Dummies (index < 0, weight 0) sort first: one per subset of the first group.
        items = sorted([(0.0, -1 - d) for d in range(pad)] + [(w, i) for i, w in enumerate(weights)])
        for g in range(0, len(items), k):
            group = items[g:g + k]
            states.append(([w for w, _ in group], [[i] for _, i in group]))
    else:
        for i, w in enumerate(weights):
            states.append(([w] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    heap = [(-(max(s) - min(s)), sid, sid) for sid, (s, _) in enumerate(states)]
    heapq.heapify(heap)
    next_id = len(states)
    while len(heap) > 1:
        _, _, sa = heapq.heappop(heap)
        _, _, sb = heapq.heappop(heap)
        (a_sums, a_mem), (b_sums, b_mem) = states[sa], states[sb]
        states[sa] = states[sb] = None  # free merged states as the C++ code moves them
        ia = sorted(range(k), key=lambda j: -a_sums[j])
        ib = sorted(range(k), key=lambda j: b_sums[j])
        sums, members = [], []
        for ja, jb in zip(ia, ib):
            sums.append(a_sums[ja] + b_sums[jb])
            x, y = a_mem[ja], b_mem[jb]
            if len(x) < len(y):  # small into large: O(n log n) copies overall
                x, y = y, x
            x.extend(y)
            members.append(x)
        states.append((sums, members))
        heapq.heappush(heap, (-(max(sums) - min(sums)), next_id, len(states) - 1))
        next_id += 1
    _, members = states[heap[0][2]]
    return [sorted(i for i in m if i >= 0) for m in members]


def cu_seqlens_py(lengths: np.ndarray) -> np.ndarray:
    """int32 prefix sums [0, L0, L0+L1, ...] of validated int64 lengths."""
    cu = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu[1:])
    if cu[-1] > np.iinfo(np.int32).max:
        # flash-attn takes int32 offsets: a micro-batch past 2^31 - 1 tokens cannot be described.
        raise ValueError(f"lengths: total {int(cu[-1])} exceeds the int32 range of cu_seqlens")
    return cu.astype(np.int32)


def position_ids_py(lengths: np.ndarray) -> np.ndarray:
    """int64 positions 0..L-1 restarting at each sequence."""
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts
