"""The bucket plan of the CPU varlen attention: which packed sequences share one padded SDPA call.

Given a packed row's `cu_seqlens` (and, for shared-prompt batches, each segment's prefix span),
`VarlenPlan` sorts the sequences by length and cuts them into buckets, each gathered into one
right-padded `[S_b, H, L_b, D]` block: length bucketing as in bucketed batch samplers, applied
per forward to stand in for flash-attn's varlen kernel, which CPU SDPA does not have (the
departure: buckets are cut by a measured call-cost model, not a fixed count). The attention
itself, and the cost constant that sizes the buckets, live in `fastgrpo.models.packed`, which
builds one plan per forward and passes the constant in.
"""
from __future__ import annotations

from typing import Optional

import torch


def tensor_version(t: torch.Tensor):
    """In-place version counter of `t` (None for an inference tensor, which has none: no cache hit)."""
    return None if t.is_inference() else t._version


class VarlenPlan:
    """How the sequences of one packed row are attended: sorted by length, cut into buckets,
    each bucket gathered into a right-padded `[S_b, H, L_b, D]` block and run as one causal SDPA.

    Right padding is exact under a causal mask: a real query at position i < L only sees keys
    ≤ i, all real; the padded rows are dropped afterwards, so their gradient is 0 and the
    gradient they send to the keys / values they touch is exactly 0 too (index_add of zeros).
    Buckets trade padding against calls: one SDPA call (forward + backward) costs about as much
    as `call_cost` query·key·(heads × head dim) products (measured on one CPU thread: ~40 µs
    per call vs ~0.3 ns per product), so a sequence joins the current bucket while the causal work its
    padding adds is below that. Measured (tiny Qwen2, one thread, forward + backward of a
    packed row): 64 sequences of 4–40 tokens 23 → 18 ms, 256 of them 123 → 64 ms (a padded
    batch: 110 ms) — the per-sequence loop spent more in slicing and its backward (a zero-filled
    [H, T, D] gradient per slice) than in attention; spread lengths (16 of 70–290 tokens) tie.

    Shared-prefix batches (`PackedBatch.segment_prefix`): a segment whose queries also attend a
    prefix span (a completion after its group's shared prompt) is gathered as queries
    `[S_b, H, Lq_b, D]` against keys / values `prefix ‖ own tokens ‖ padding` `[S_b, H, Lk_b, D]`
    with an explicit mask (query i sees key j iff j ≤ prefix length + i): the same exactness
    argument holds, and the prefix tokens' gradients are summed over every segment that read
    them (index_select's backward).
    """

    __slots__ = ("cu", "version", "prefix", "prefix_version", "device", "width", "buckets", "unpad", "_bias",
                 "_tail")

    def __init__(self, cu: torch.Tensor, device, width: int, prefix: Optional[torch.Tensor] = None,
                 call_cost: int = 150_000):
        bounds = cu.tolist()
        pre = prefix.tolist() if prefix is not None else [(0, 0)] * (len(bounds) - 1)
        if len(pre) != len(bounds) - 1 or any(len(r) != 2 for r in pre):
            raise ValueError(f"segment_prefix: expected {len(bounds) - 1} (start, length) rows (one per "
                             f"segment), got shape {tuple(prefix.shape)}")
        for s_, (ps, pl) in enumerate(pre):
            if pl != 0 and not (0 <= ps and pl > 0 and ps + pl <= bounds[s_]):
                raise ValueError(f"segment_prefix[{s_}] = ({ps}, {pl}): a prefix must be a span of tokens "
                                 f"(length >= 0) before its segment, which starts at token {bounds[s_]}")
        seqs = sorted(((bounds[s + 1] - bounds[s], bounds[s]) for s in range(len(bounds) - 1)
                       if bounds[s + 1] > bounds[s] and pre[s][1] == 0), reverse=True)
        groups = []  # [(L_b, [lengths], [starts])], longest first
        for n, a in seqs:
            if groups and width * (groups[-1][0] ** 2 - n * n) // 2 <= call_cost:
                groups[-1][1].append(n)
                groups[-1][2].append(a)
            else:
                groups.append((n, [n], [a]))
        unpad = torch.empty(bounds[-1] if bounds else 0, dtype=torch.int64)
        self.buckets, offset = [], 0
        for L, lens, starts in groups:
            n = torch.tensor(lens, dtype=torch.int64)[:, None]
            a = torch.tensor(starts, dtype=torch.int64)[:, None]
            t = torch.arange(L, dtype=torch.int64)[None]
            # pad slots re-read the sequence's last token: any real row works, the gradient
            # they send back is exactly 0 (see the class docstring)
            idx = a + torch.minimum(t, n - 1)
            real = t < n
            unpad[(a + t)[real]] = (offset + torch.arange(len(lens))[:, None] * L + t)[real]
            idx = idx.reshape(-1).to(device)
            self.buckets.append((idx, idx, len(lens), L, L, None))
            offset += len(lens) * L
        # prefixed segments, by key length (prefix + own), longest first; a segment joins the
        # bucket while the query·key work its padding adds stays under one call's cost
        segs = sorted(((pre[s][1] + bounds[s + 1] - bounds[s], bounds[s + 1] - bounds[s], bounds[s], pre[s][0],
                        pre[s][1]) for s in range(len(bounds) - 1) if bounds[s + 1] > bounds[s] and pre[s][1] > 0),
                      reverse=True)
        pgroups = []  # [[Lq, Lk, [segments]]]
        for seg in segs:
            kl, n = seg[0], seg[1]
            if pgroups:
                lq0, lk0, members = pgroups[-1]
                lq, lk = max(lq0, n), max(lk0, kl)
                added = (len(members) + 1) * lq * lk - len(members) * lq0 * lk0 - n * kl
                if width * added <= call_cost:
                    pgroups[-1][0], pgroups[-1][1] = lq, lk
                    members.append(seg)
                    continue
            pgroups.append([n, kl, [seg]])
        for lq, lk, members in pgroups:
            n = torch.tensor([m[1] for m in members], dtype=torch.int64)[:, None]
            a = torch.tensor([m[2] for m in members], dtype=torch.int64)[:, None]
            ps = torch.tensor([m[3] for m in members], dtype=torch.int64)[:, None]
            pl = torch.tensor([m[4] for m in members], dtype=torch.int64)[:, None]
            t = torch.arange(lq, dtype=torch.int64)[None]
            j = torch.arange(lk, dtype=torch.int64)[None]
            q_idx = a + torch.minimum(t, n - 1)
            k_idx = torch.where(j < pl, ps + torch.minimum(j, pl - 1), a + (j - pl).clamp(0).minimum(n - 1))
            real = t < n
            unpad[(a + t)[real]] = (offset + torch.arange(len(members))[:, None] * lq + t)[real]
            # query i of a row sees key j iff j <= prefix length + i (never a pad key when i is real)
            keep = j[:, None, :] <= (pl[:, :, None] + t[:, :, None])
            self.buckets.append((q_idx.reshape(-1).to(device), k_idx.reshape(-1).to(device), len(members), lq, lk,
                                 keep.to(device)))
            offset += len(members) * lq
        self.unpad = unpad.to(device)
        self.cu, self.version, self.device, self.width = cu, tensor_version(cu), device, width
        self.prefix = prefix
        self.prefix_version = tensor_version(prefix) if prefix is not None else None
        self._bias = {}
        self._tail = {}

    def rows(self, t: int) -> torch.Tensor:
        """The gather map from the buckets' output rows to `t` ≥ T token rows: the rows past
        the last segment (the ladder padding of `fastgrpo.models.onednn`, which attends nothing)
        read the zero row appended after the buckets' output."""
        extra = t - self.unpad.numel()
        if extra <= 0:
            return self.unpad
        out = self._tail.get(t)
        if out is None:
            zero_row = sum(n * lq for _, _, n, lq, _, _ in self.buckets)
            out = self._tail[t] = torch.cat([self.unpad, self.unpad.new_full((extra,), zero_row)])
        return out

    def bias(self, b: int, dtype, g: int = 0, hk: int = 0) -> torch.Tensor:
        """Additive mask (0 / -inf) of prefixed bucket `b`, built once per forward and shared by
        every layer (so autograd keeps one copy, not one per layer): [n, 1, Lq, Lk] for SDPA
        (g = 0), or laid out for `_short_causal_attention`'s [n·Hkv, g·Lq, Lk] scores."""
        key = (b, dtype, g, hk)
        out = self._bias.get(key)
        if out is None:
            keep = self.buckets[b][5]
            add = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))
            out = add[:, None] if g == 0 else add.repeat(1, g, 1).repeat_interleave(hk, dim=0)
            self._bias[key] = out
        return out
