"""Packed micro-batches: `PackedBatch`, `build_packed_batches` (unshared and shared-prefix
layouts) and `unpack`, on top of `fastgrpo.packing.bins` (cu_seqlens) and the micro-batch
planner `fastgrpo.packing.plan`.

The layouts follow flash-attn's varlen convention (TRL's padding-free training, verl's remove
padding): sequences concatenated into one row, `cu_seqlens` offsets, positions restarting per
sequence. Departure: the shared-prefix layout (`share_prefix=True`) carries a GRPO group's prompt
once and needs an attention that takes a per-segment prefix span (fastgrpo.models.packed's CPU varlen
attention); see `PackedBatch`.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from fastgrpo.packing.bins import DEFAULT_ATTN_COEF, Workload, build_cu_seqlens, check_budget, is_int
from fastgrpo.packing.plan import plan_micro_batches


@dataclass
class PackedBatch:
    """One token-budget micro-batch of S packed sequences (prompt + completion each).

    Two index spaces (T = packed tokens, N = completion tokens, S = sequences):

    Token space, the model input `[T]`:
      input_ids      int64  prompt_0 ‖ completion_0 ‖ prompt_1 ‖ completion_1 ‖ …
      position_ids   int64  0..L_s-1 restarting at each sequence (L_s = P_s + C_s)
      cu_seqlens     int32  [S+1] sequence offsets in token space (flash-attn varlen)
      max_seqlen     int    max L_s
      mask           bool   True on completion tokens
      segment_prefix None

    Shared-prefix layout (`build_packed_batches(..., share_prefix=True)`): the sequences of a
    micro-batch that have the same prompt (a GRPO group) carry it once, prompt ‖ completion_a ‖
    completion_b ‖ …, every completion positioned after the prompt (positions P..P+C-1). The
    model input is then cut into K attention *segments* (a shared prompt, a completion, or an
    unshared prompt ‖ completion) and
      cu_seqlens     int32  [K+1] segment offsets in token space
      segment_prefix int64  [K, 2] (start, length) of the token span that every query of segment
                            k attends to before the segment's own causal span: its prompt for a
                            completion of a shared prompt, (0, 0) otherwise
      max_seqlen     int    max over segments of prefix length + segment length
    Only the varlen CPU attention of `fastgrpo.models.packed` runs this layout (flash-attn and
    attn="mask" refuse it); the completion-space fields below keep their meaning and order.

    Completion space, the loss input `[N]` (the loss contract of DESIGN.md, ready to pass to
    `grpo_loss` / `fused_linear_grpo_loss` with `cu_seqlens=loss_cu_seqlens`):
      logit_index    int64  token-space position t whose logit predicts completion token n;
                            the logit at t predicts token t+1, so logit_index = (position of
                            the completion token) − 1. Sequence s contributes positions
                            cu_seqlens[s] + P_s − 1 … cu_seqlens[s] + L_s − 2; the last token
                            of each sequence predicts nothing needed.
      targets        int64  the completion tokens (= input_ids[logit_index + 1])
      advantages     f32    per token (a per-sequence advantage broadcast over its completion)
      old_logp, ref_logp, weights   f32 or None
      behav_logp     f32 or None: the rollout engine's own sampling log-probs (the behaviour
                            policy μ) when they differ from the policy's, for the off-policy
                            correction (fastgrpo.correction); not an input of the loss itself
      loss_mask      f32    1 where the token counts in the loss (all ones unless a
                            completion_mask was given, e.g. to drop truncated completions)
      loss_cu_seqlens int32 [S+1] sequence offsets in completion space

    Map back: `seq_index[s]` is the rollout index (position in the inputs to
    `build_packed_batches`) of packed sequence s; `ids[s]` its (prompt id, sample id).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    mask: torch.Tensor
    logit_index: torch.Tensor
    targets: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_cu_seqlens: torch.Tensor
    prompt_lens: torch.Tensor
    completion_lens: torch.Tensor
    seq_index: torch.Tensor
    ids: List[Tuple[int, int]]
    old_logp: Optional[torch.Tensor] = None
    ref_logp: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    segment_prefix: Optional[torch.Tensor] = None
    behav_logp: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        """T: tokens fed to the model."""
        return int(self.input_ids.numel())

    @property
    def num_completion_tokens(self) -> int:
        """N: completion tokens (rows of the loss); sum over micro-batches for a global token-mean."""
        return int(self.targets.numel())

    @property
    def num_loss_tokens(self) -> int:
        """Completion tokens with loss_mask 1 (the token-mean denominator contribution)."""
        return int(self.loss_mask.sum().item())

    @property
    def num_seqs(self) -> int:
        return int(self.seq_index.numel())

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        """Copy of the batch with every tensor on `device` (max_seqlen and ids stay host-side)."""
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                moved[f.name] = v.to(device, non_blocking=non_blocking)
        return replace(self, **moved)


# The builders below work in numpy (single-threaded): on an oversubscribed CPU torch's intra-op
# threads slowed these index ops 30x (46 s vs 1.7 s for 8192 rollouts, 19.5 M tokens).

def _host_array(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _as_ids(x, name: str, i: int) -> np.ndarray:
    t = _host_array(x)
    # dtype.kind instead of np.issubdtype: the same test at a fraction of the cost (per sequence)
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise ValueError(f"{name}[{i}]: expected a 1-D list/tensor of integer token ids, got "
                         f"dtype {t.dtype}, shape {tuple(t.shape)}")
    return t.astype(np.int64, copy=False)


def _ids_list(seqs: Sequence, name: str) -> List[np.ndarray]:
    """Each sequence as int64 numpy; an object passed several times (a GRPO group's prompt: G
    references to one list) is converted once."""
    seen: dict = {}  # id(x) -> (x, array): holding x keeps its id from being reused by a later item
    out = []
    for i, x in enumerate(seqs):
        hit = seen.get(id(x))
        if hit is None:
            hit = seen[id(x)] = (x, _as_ids(x, name, i))
        out.append(hit[1])
    return out


class _Ragged:
    """Per-sequence arrays stored back to back: `flat` and offsets `off` [S+1]. A micro-batch
    gathers its sequences with one index op instead of one array per sequence."""

    def __init__(self, flat: np.ndarray, lens: np.ndarray):
        self.flat = flat
        self.off = np.zeros(lens.size + 1, dtype=np.int64)
        np.cumsum(lens, out=self.off[1:])

    def take(self, seqs: np.ndarray, identity: bool) -> torch.Tensor:
        if identity:  # every sequence in input order (one micro-batch): the flat array itself
            return torch.from_numpy(self.flat)
        return torch.from_numpy(self.flat[_ragged_index(self.off, seqs)])


def _ragged_index(off: np.ndarray, seqs: np.ndarray) -> np.ndarray:
    """Flat positions of sequences `seqs` (in that order) of a ragged array with offsets `off`."""
    starts = off[seqs]
    lens = off[seqs + 1] - starts
    out_start = np.cumsum(lens) - lens
    return np.repeat(starts - out_start, lens) + np.arange(int(lens.sum()), dtype=np.int64)


def _per_token(values, name: str, comp_lens: List[int], allow_scalar: bool,
               lens: np.ndarray) -> Optional[_Ragged]:
    """Per-sequence values → float32 [C_s] each, stored ragged (a scalar broadcasts when allowed)."""
    if values is None:
        return None
    if len(values) != len(comp_lens):
        raise ValueError(f"{name}: expected {len(comp_lens)} entries (one per sequence), got {len(values)}")
    if allow_scalar and all(isinstance(v, (float, int)) for v in values):
        # one Python number per sequence (the trainer's advantages), rounded to float32 as below
        return _Ragged(np.repeat(np.asarray(values, dtype=np.float32), lens), lens)
    out = []
    for i, (v, c) in enumerate(zip(values, comp_lens)):
        t = _host_array(v).astype(np.float32, copy=False)
        if t.ndim == 0 and allow_scalar:
            t = np.full(c, t, dtype=np.float32)
        elif t.ndim != 1 or t.size != c:
            want = "a float or " if allow_scalar else ""
            raise ValueError(f"{name}[{i}]: expected {want}{c} per-token values (one per completion "
                             f"token), got shape {tuple(t.shape)}")
        out.append(t)
    return _Ragged(np.concatenate(out) if out else np.zeros(0, dtype=np.float32), lens)


def build_packed_batches(prompt_ids: Sequence, completion_ids: Sequence, advantages: Sequence,
                         token_budget: int, *, old_logp: Optional[Sequence] = None,
                         ref_logp: Optional[Sequence] = None, weights: Optional[Sequence] = None,
                         behav_logp: Optional[Sequence] = None, completion_mask: Optional[Sequence] = None,
                         ids: Optional[Sequence[Tuple[int, int]]] = None, group_size: int = 1,
                         allow_oversize: bool = False, min_micro_batches: int = 1,
                         workload: Workload = "tokens",
                         attn_coef: float = DEFAULT_ATTN_COEF, share_prefix: bool = False,
                         plan: Optional[Sequence[Sequence[int]]] = None) -> List[PackedBatch]:
    """Pack rollouts into micro-batches of at most `token_budget` tokens (first-fit-decreasing).

    Inputs, one entry per rollout sequence i: `prompt_ids[i]` (≥ 1 token: the first completion
    token is predicted from the last prompt token), `completion_ids[i]` (≥ 0 tokens),
    `advantages[i]` (a float broadcast over the completion, or C_i per-token values), and
    optionally per-token `old_logp`, `ref_logp`, `weights`, `behav_logp`, `completion_mask` (C_i
    values each).
    `ids[i]` = (prompt id, sample id); by default (i // group_size, i % group_size).

    Log-prob convention: in the packed sequence prompt ‖ completion, the logit at position t
    predicts token t+1. The loss targets are the completion tokens, so logits are needed only
    at the positions whose next token is a completion token: `PackedBatch.logit_index`
    (the last prompt token … the second-to-last completion token). `old_logp[i][j]` must be the
    log-prob of completion token j of sequence i, i.e. aligned with `targets`.

    A sequence longer than `token_budget` raises ValueError naming it, or gets a micro-batch of
    its own when `allow_oversize=True`. Empty input gives `[]`.

    `min_micro_batches`: data-parallel ranks must run the same number of forward/backward
    passes per step, so a trainer takes the max of `len(batches)` over ranks and rebuilds with
    it. When first-fit-decreasing gives fewer bins, the sequences are instead split by
    Karmarkar–Karp (`balance_partitions` with `workload` / `attn_coef`) into that many
    micro-batches, adding one at a time until every one fits the budget (as verl's dynamic
    batch size does). It cannot exceed the number of sequences (no empty micro-batch).

    `share_prefix=True`: inside each micro-batch, sequences with identical prompt tokens carry
    the prompt once (see `PackedBatch`, shared-prefix layout): a GRPO group of G completions
    runs its prompt through the model once instead of G times, with the same log-probs and
    gradients — for the groups where `shares_prefix(P, C, attn_coef)` expects it to pay (pass
    `attn_coef` ≈ 6·hidden size of the model). Micro-batches are still cut by the unshared
    lengths (never more tokens than the budget; a shared batch is smaller).

    `plan`: the micro-batches already decided (lists of sequence indices, e.g. by
    `fastgrpo.packing.plan_micro_batches` across ranks); each non-empty list becomes one batch
    in that order, and the budget is not consulted again. Every sequence may appear at most once.
    """
    n = len(prompt_ids)
    if len(completion_ids) != n:
        raise ValueError(f"completion_ids: expected {n} sequences (as prompt_ids), got {len(completion_ids)}")
    if len(advantages) != n:
        raise ValueError(f"advantages: expected {n} entries (one per sequence), got {len(advantages)}")
    if not is_int(group_size) or group_size < 1:
        raise ValueError(f"group_size={group_size!r}: expected an integer >= 1")
    budget = check_budget(token_budget)
    prompts = _ids_list(prompt_ids, "prompt_ids")
    comps = [_as_ids(c, "completion_ids", i) for i, c in enumerate(completion_ids)]
    for i, p in enumerate(prompts):
        if p.size == 0:
            raise ValueError(f"prompt_ids[{i}] is empty: expected >= 1 token (the first completion "
                             "token is predicted from the last prompt token)")
    comp_lens = [int(c.size) for c in comps]
    lens = np.array(comp_lens, dtype=np.int64)
    per_token = dict(
        targets=_Ragged(np.concatenate(comps) if comps else np.zeros(0, dtype=np.int64), lens),
        advantages=_per_token(advantages, "advantages", comp_lens, True, lens),
        old_logp=_per_token(old_logp, "old_logp", comp_lens, False, lens),
        ref_logp=_per_token(ref_logp, "ref_logp", comp_lens, False, lens),
        weights=_per_token(weights, "weights", comp_lens, False, lens),
        behav_logp=_per_token(behav_logp, "behav_logp", comp_lens, False, lens),
        loss_mask=_per_token(completion_mask, "completion_mask", comp_lens, False, lens),
    )
    if per_token["loss_mask"] is None:  # every token counts
        per_token["loss_mask"] = _Ragged(np.ones(int(lens.sum()), dtype=np.float32), lens)
    if ids is None:
        ids = [(i // group_size, i % group_size) for i in range(n)]
    elif len(ids) != n:
        raise ValueError(f"ids: expected {n} (prompt id, sample id) pairs, got {len(ids)}")
    ids = [(int(a), int(b)) for a, b in ids]

    if plan is None:
        lengths = [int(p.size) + c for p, c in zip(prompts, comp_lens)]
        bins = plan_micro_batches(lengths, budget, allow_oversize, min_micro_batches=min_micro_batches,
                                  workload=workload, attn_coef=attn_coef)
    else:
        bins = [list(b) for b in plan if len(b)]
        flat = [int(i) for b in bins for i in b]
        if len(set(flat)) != len(flat) or any(not 0 <= i < n for i in flat):
            raise ValueError(f"plan: expected lists of distinct sequence indices in [0, {n}), got {plan!r}")
    batches = []
    for b in bins:
        seqs = sorted(b)  # rollout order inside a micro-batch: easier to read, same cost
        groups = _share_groups(seqs, prompts, comp_lens, attn_coef) if share_prefix else [[i] for i in seqs]
        batches.append(_layout(groups, prompts, comps, comp_lens, per_token, ids, shared=share_prefix))
    return batches


def _share_groups(seqs, prompts, comp_lens, attn_coef) -> List[List[int]]:
    """Sequences regrouped by prompt tokens (first appearance order); a group that
    `shares_prefix` rejects is split into single sequences (ordinary segments)."""
    by_prompt: dict = {}
    keys: dict = {}  # one tobytes per prompt array (a group's sequences share one, see _ids_list)
    for i in seqs:
        p = prompts[i]
        key = keys.get(id(p))
        if key is None:
            key = keys[id(p)] = p.tobytes()
        by_prompt.setdefault(key, []).append(i)
    groups = []
    for members in by_prompt.values():
        if shares_prefix(int(prompts[members[0]].size), [comp_lens[i] for i in members], attn_coef):
            groups.append(members)
        else:
            groups.extend([i] for i in members)
    return groups


def shares_prefix(prompt_len: int, completion_lens: Sequence[int], attn_coef: float = DEFAULT_ATTN_COEF) -> bool:
    """Whether a group of completions of one prompt is cheaper with the prompt carried once.
    Cost model of `balance_partitions` (a·L + L² for a causal sequence of L tokens; a dense
    query × key block of q × k pairs costs 2·q·k): unshared Σ a(P + C_j) + (P + C_j)², shared
    a·P + P² + Σ a·C_j + 2·C_j(P + C_j) (the completions' blocks are masked, not skipped), so
    sharing wins iff (G − 1)(a·P + P²) > Σ C_j². Long completions behind a short prompt stay
    unshared: measured on the demo model (1 thread), sharing 7-token prompts took the update
    from 84 to 79 ms with ≤ 128-token completions, and from 103 to 110 ms with ≤ 256."""
    g = len(completion_lens)
    return g >= 2 and (g - 1) * (attn_coef * prompt_len + prompt_len ** 2) > sum(c * c for c in completion_lens)


def _layout(groups, prompts, comps, comp_lens, per_token, ids, shared: bool) -> PackedBatch:
    """One micro-batch of the sequences in `groups` (see `PackedBatch`): a group of several
    sequences carries its prompt once (shared-prefix layout), a group of one is an ordinary
    prompt ‖ completion segment. Completion space follows the sequences in group order.

    Only the segments are walked in Python; positions, logit indices and the completion mask
    come from a few ragged-arange ops over them (a dozen numpy calls per sequence would cost
    ~0.4 ms of the 64-sequence demo step)."""
    pieces, piece_len, piece_pos0 = [], [], []  # token-space pieces, position of their first token
    seg_lens, prefix = [], []
    comp_start, shared_last = [], []  # per sequence: token offset of its completion; shared prompt's last token
    t = 0
    for members in groups:
        i0 = members[0]
        prompt = prompts[i0]
        p = int(prompt.size)
        if len(members) == 1:  # nothing to share: prompt ‖ completion, positions 0..P+C-1
            c = comp_lens[i0]
            pieces += (prompt, comps[i0])
            piece_len += (p, c)
            piece_pos0 += (0, p)
            seg_lens.append(p + c)
            prefix.append((0, 0))
            comp_start.append(t + p)
            shared_last.append(-1)
            t += p + c
            continue
        start = t
        pieces.append(prompt)
        piece_len.append(p)
        piece_pos0.append(0)
        seg_lens.append(p)
        prefix.append((0, 0))
        t += p
        for i in members:
            c = comp_lens[i]
            comp_start.append(t)
            shared_last.append(start + p - 1)  # predicts the first completion token
            if c == 0:
                continue  # no tokens, no segment; the sequence keeps its empty completion-space slice
            pieces.append(comps[i])
            piece_len.append(c)
            piece_pos0.append(p)  # every completion is positioned after its prompt
            seg_lens.append(c)
            prefix.append((start, p))
            t += c
    seqs = [i for members in groups for i in members]
    order = np.array(seqs, dtype=np.int64)
    plen = np.array(piece_len, dtype=np.int64)
    positions = np.arange(t, dtype=np.int64) - np.repeat(np.cumsum(plen) - plen - np.array(piece_pos0, dtype=np.int64), plen)
    c_lens = np.array([comp_lens[i] for i in seqs], dtype=np.int64)
    loss_cu = build_cu_seqlens(c_lens)
    c_off = loss_cu.numpy()[:-1].astype(np.int64)
    # token position of every completion token; the logit before it predicts it (logit_index),
    # except the first token after a shared prompt, predicted by that prompt's last token
    tok = np.repeat(np.array(comp_start, dtype=np.int64) - c_off, c_lens) + np.arange(int(c_lens.sum()), dtype=np.int64)
    logit_index = tok - 1
    last = np.array(shared_last, dtype=np.int64)
    fix = (last >= 0) & (c_lens > 0)
    logit_index[c_off[fix]] = last[fix]
    mask = np.zeros(t, dtype=bool)
    mask[tok] = True
    seg = np.array(seg_lens, dtype=np.int64)
    pre = np.array(prefix, dtype=np.int64).reshape(-1, 2)
    identity = seqs == list(range(len(comp_lens)))
    return PackedBatch(
        input_ids=torch.from_numpy(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)),
        position_ids=torch.from_numpy(positions),
        cu_seqlens=build_cu_seqlens(seg),
        max_seqlen=int((seg + pre[:, 1]).max()),
        mask=torch.from_numpy(mask),
        logit_index=torch.from_numpy(logit_index),
        segment_prefix=torch.from_numpy(pre) if shared else None,
        loss_cu_seqlens=loss_cu,
        prompt_lens=torch.from_numpy(np.array([prompts[i].size for i in seqs], dtype=np.int64)),
        completion_lens=torch.from_numpy(c_lens),
        seq_index=torch.from_numpy(order),
        ids=[ids[i] for i in seqs],
        **{k: (None if v is None else v.take(order, identity)) for k, v in per_token.items()},
    )


def unpack(batch: PackedBatch, per_token: torch.Tensor) -> List[torch.Tensor]:
    """Per-sequence completion tensors from a packed per-token tensor, in the batch's order
    (sequence s is rollout `batch.seq_index[s]`).

    `per_token` is either in completion space (`[N, ...]`, e.g. log-probs from
    `packed_logprobs`, or the loss's per-token output) or in token space (`[T, ...]`, e.g. the
    model's full output; the completion tokens are taken at `batch.mask`). Each result is a view
    or slice of length C_s. Since every prompt has ≥ 1 token, N < T and the two cannot be confused.
    """
    if not isinstance(per_token, torch.Tensor) or per_token.ndim < 1:
        raise ValueError("per_token: expected a tensor with the token dimension first")
    rows = per_token.shape[0]
    if rows == batch.num_tokens:
        per_token = per_token[batch.mask.to(per_token.device)]
    elif rows != batch.num_completion_tokens:
        raise ValueError(f"per_token: first dimension {rows} matches neither the completion tokens "
                         f"(N={batch.num_completion_tokens}) nor the packed tokens (T={batch.num_tokens})")
    return list(torch.split(per_token, batch.completion_lens.tolist()))
