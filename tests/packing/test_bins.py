"""Packing and balancing: both backends (C++ fastgrpo._C and the Python twin) on random inputs,
their invariants, identical results, bad input; PackedBatch layout and unpack."""
import importlib
import random

import numpy as np
import pytest
import torch

from fastgrpo.native import ext as _cext
from fastgrpo.packing import bins as P
from fastgrpo.packing import layout as L

BACKENDS = ["py", "c"]


@pytest.fixture(autouse=True)
def _load_extension(monkeypatch):
    """Both backends are tested even under FASTGRPO_DISABLE_EXT=1 (which only changes what the
    public functions pick): the compiled module is loaded directly; a missing build fails."""
    monkeypatch.setattr(_cext, "C", importlib.import_module("fastgrpo._C"))


def _pack(backend):
    return {"py": P.pack_sequences_py, "c": P.pack_sequences_c}[backend]


def _balance(backend):
    return {"py": P.balance_partitions_py, "c": P.balance_partitions_c}[backend]


def _random_lengths(rng, n, hi):
    return [rng.randint(0, hi) if rng.random() < 0.9 else rng.randint(0, 3) for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_invariants(backend):
    rng = random.Random(0)
    for _ in range(150):
        n, budget = rng.randint(1, 400), rng.randint(1, 300)
        lengths = [min(x, budget) for x in _random_lengths(rng, n, budget)]
        bins = _pack(backend)(lengths, budget)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(n)), "every index exactly once"
        loads = [sum(lengths[i] for i in b) for b in bins]
        assert max(loads) <= budget and all(len(b) for b in bins)
        # First fit never leaves two bins at most half full (a later item would have joined).
        assert sum(2 * x <= budget for x in loads) <= 1 or sum(lengths) == 0
        # And uses no more bins than a trivially-valid bound: ceil(2·total/budget) + 1.
        assert len(bins) <= -(-2 * sum(lengths) // budget) + 1


def test_pack_backends_identical():
    rng = random.Random(1)
    for _ in range(150):
        n, budget = rng.randint(0, 500), rng.randint(1, 200)
        lengths = _random_lengths(rng, n, int(budget * 1.3))
        assert P.pack_sequences_py(lengths, budget, allow_oversize=True) == \
            P.pack_sequences_c(lengths, budget, allow_oversize=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pack_known_and_edge_cases(backend):
    pack = _pack(backend)
    assert pack([5, 3, 7, 2], 8) == [[2], [0, 1], [3]]  # FFD by hand: 7 | 5+3 | 2
    assert pack([], 8) == []
    assert pack([8, 8], 8) == [[0], [1]]  # exactly at the budget
    assert pack(np.array([4, 4], dtype=np.int32), 8) == [[0, 1]]
    assert pack(torch.tensor([3, 0, 5]), 8) == [[2, 0, 1]]
    with pytest.raises(ValueError, match="sequence 1 has length 9"):
        pack([2, 9, 3], 8)
    assert pack([2, 9, 3, 12], 8, allow_oversize=True) == [[3], [1], [2, 0]]
    with pytest.raises(ValueError, match=r"lengths\[1\] = -1"):
        pack([2, -1], 8)
    for bad in ([2, 3.0], [2, "3"], np.array([1.5])):
        with pytest.raises(ValueError, match="lengths"):
            pack(bad, 8)
    for budget in (0, -3, 2.5):
        with pytest.raises(ValueError, match="max_tokens"):
            pack([1], budget)


def _spread_ok(lengths, parts, workload, coef):
    loads = P.partition_loads(lengths, parts, workload, coef)
    w = P._workloads(P._as_lengths(lengths), workload, coef)
    return max(loads) - min(loads) <= w.max() + 1e-6 * max(1.0, w.max())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("equal_size", [False, True])
def test_balance_invariants(backend, equal_size):
    rng = random.Random(2)
    for _ in range(80):
        n, k = rng.randint(1, 300), rng.randint(1, 12)
        lengths = _random_lengths(rng, n, 5000)
        workload = rng.choice(["tokens", "attention", lambda L: 3.0 * L + 7])
        parts = _balance(backend)(lengths, k, equal_size=equal_size, workload=workload, attn_coef=100.0)
        assert len(parts) == k
        assert sorted(i for p in parts for i in p) == list(range(n))
        assert all(p == sorted(p) for p in parts)
        if equal_size:
            sizes = [len(p) for p in parts]
            assert max(sizes) - min(sizes) <= 1
        # Differencing never widens the spread beyond the largest single workload.
        assert _spread_ok(lengths, parts, workload, 100.0)


def test_balance_backends_identical_and_good():
    rng = np.random.default_rng(3)
    for trial in range(60):
        n, k = int(rng.integers(0, 600)), int(rng.integers(1, 17))
        lengths = np.clip(rng.lognormal(7, 1, size=n), 1, 16384).astype(np.int64)
        for eq in (False, True):
            for wl in ("tokens", "attention"):
                a = P.balance_partitions_py(lengths, k, eq, wl, 4096.0)
                b = P.balance_partitions_c(lengths, k, eq, wl, 4096.0)
                assert a == b, (trial, eq, wl)
    # Quality on a large, long-tailed batch: within 3 % of perfect balance for k = 8.
    lengths = np.clip(rng.lognormal(7, 1, size=512), 64, 16384).astype(np.int64)
    loads = P.partition_loads(lengths, P.balance_partitions(lengths, 8))
    assert max(loads) / (sum(loads) / 8) <= 1.03


@pytest.mark.parametrize("backend", BACKENDS)
def test_balance_edge_cases(backend):
    bal = _balance(backend)
    assert bal([], 4) == []
    assert bal([5], 3) == [[0], [], []] or sorted(map(len, bal([5], 3))) == [0, 0, 1]
    assert bal([3, 1, 2], 1) == [[0, 1, 2]]
    assert bal([4, 4, 4, 4], 2, equal_size=True) in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 3], [1, 2]],
                                                     [[1, 2], [0, 3]], [[1, 3], [0, 2]], [[2, 3], [0, 1]])
    # equal_size with n not divisible by k: sizes 2, 2, 1 in some order
    assert sorted(map(len, bal([9, 1, 1, 1, 1], 3, equal_size=True))) == [1, 2, 2]
    for k in (0, 2.0, -1):
        with pytest.raises(ValueError, match="k="):
            bal([1, 2], k)
    with pytest.raises(ValueError, match="workload="):
        bal([1, 2], 2, workload="flops")
    with pytest.raises(ValueError, match="workload of sequence 1"):
        bal([1, 2], 2, workload=lambda L: -1.0 if L == 2 else 1.0)
    with pytest.raises(ValueError, match="attn_coef"):
        bal([1, 2], 2, workload="attention", attn_coef=float("nan"))
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        bal([-4], 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layout_builders(backend):
    cu_fn = {"py": P.build_cu_seqlens_py, "c": P.build_cu_seqlens_c}[backend]
    pos_fn = {"py": P.build_position_ids_py, "c": P.build_position_ids_c}[backend]
    rng = random.Random(4)
    for _ in range(50):
        lengths = [rng.randint(0, 40) for _ in range(rng.randint(0, 30))]
        cu, pos = cu_fn(lengths), pos_fn(lengths)
        assert cu.dtype == torch.int32 and pos.dtype == torch.int64
        assert cu.tolist() == [0] + list(np.cumsum(lengths, dtype=np.int64)) if lengths else cu.tolist() == [0]
        assert pos.tolist() == [p for L in lengths for p in range(L)]
    with pytest.raises(ValueError, match="int32"):
        cu_fn([2**30, 2**30])
    with pytest.raises(ValueError, match=r"lengths\[1\]"):
        pos_fn([1, -2])


def _rollouts(rng, n, vocab=50, max_p=12, max_c=20):
    prompts = [torch.randint(3, vocab, (rng.randint(1, max_p),)) for _ in range(n)]
    comps = [torch.randint(3, vocab, (rng.randint(0, max_c),)) for _ in range(n)]
    return prompts, comps


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_batch_layout_and_unpack(backend, monkeypatch):
    if backend == "py":
        monkeypatch.setattr(_cext, "C", None)
    rng = random.Random(5)
    for _ in range(20):
        n, budget = rng.randint(1, 40), rng.randint(32, 80)
        prompts, comps = _rollouts(rng, n)
        adv = [rng.uniform(-1, 1) for _ in range(n)]
        olp = [-torch.rand(len(c)) for c in comps]
        cm = [(torch.rand(len(c)) > 0.2).float() for c in comps]
        batches = L.build_packed_batches(prompts, comps, adv, budget, old_logp=olp, ref_logp=olp,
                                         completion_mask=cm, group_size=4)
        seen = torch.cat([b.seq_index for b in batches]).sort().values
        assert seen.tolist() == list(range(n))
        for b in batches:
            assert b.num_tokens <= budget and b.cu_seqlens.dtype == torch.int32
            assert b.cu_seqlens[-1].item() == b.num_tokens == b.position_ids.numel()
            assert b.max_seqlen == int((b.prompt_lens + b.completion_lens).max())
            # The convention: the logit at t predicts token t+1, a completion token.
            assert torch.equal(b.input_ids[b.logit_index + 1], b.targets)
            assert torch.equal(b.mask.nonzero()[:, 0], b.logit_index + 1)
            assert b.num_completion_tokens == int(b.mask.sum()) == int(b.completion_lens.sum())
            for s, i in enumerate(b.seq_index.tolist()):
                a0 = int(b.cu_seqlens[s])
                seq = b.input_ids[a0:int(b.cu_seqlens[s + 1])]
                assert torch.equal(seq, torch.cat([prompts[i], comps[i]]))
                assert b.position_ids[a0:a0 + len(seq)].tolist() == list(range(len(seq)))
                assert b.ids[s] == (i // 4, i % 4)
            for got, i in zip(L.unpack(b, b.advantages), b.seq_index.tolist()):
                assert torch.allclose(got, torch.full((len(comps[i]),), adv[i]))
            for got, i in zip(L.unpack(b, b.old_logp), b.seq_index.tolist()):
                assert torch.equal(got, olp[i])
            for got, i in zip(L.unpack(b, b.loss_mask), b.seq_index.tolist()):
                assert torch.equal(got, cm[i])
            # token-space input: completion tokens are picked through the mask
            for got, i in zip(L.unpack(b, b.input_ids), b.seq_index.tolist()):
                assert torch.equal(got, comps[i])
            assert b.num_loss_tokens == int(b.loss_mask.sum())
            moved = b.to("cpu")
            assert torch.equal(moved.logit_index, b.logit_index) and moved.ids == b.ids


def test_packed_batch_backends_identical(monkeypatch):
    rng = random.Random(6)
    prompts, comps = _rollouts(rng, 60)
    adv = [float(i) for i in range(60)]
    with_c = L.build_packed_batches(prompts, comps, adv, 64)
    monkeypatch.setattr(_cext, "C", None)
    with_py = L.build_packed_batches(prompts, comps, adv, 64)
    assert len(with_c) == len(with_py)
    for a, b in zip(with_c, with_py):
        for name in ("input_ids", "position_ids", "cu_seqlens", "logit_index", "targets", "advantages"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_packed_batch_bad_input():
    p, c = [[1, 2], [3]], [[4], [5, 6]]
    assert L.build_packed_batches([], [], [], 16) == []
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        L.build_packed_batches([[1], []], c, [0.0, 0.0], 16)
    with pytest.raises(ValueError, match="sequence 1 has length 3 > max_tokens=2"):
        L.build_packed_batches([[1], [3]], [[4], [5, 6]], [0.0, 0.0], 2)
    big = L.build_packed_batches([[1], [3]], [[4], [5, 6]], [0.0, 0.0], 2, allow_oversize=True)
    assert sorted(b.num_tokens for b in big) == [2, 3]
    with pytest.raises(ValueError, match=r"old_logp\[1\]: expected 2 per-token"):
        L.build_packed_batches(p, c, [0.0, 0.0], 16, old_logp=[[0.1], [0.1]])
    with pytest.raises(ValueError, match=r"advantages\[0\]: expected a float or 1"):
        L.build_packed_batches(p, c, [[0.1, 0.2], 0.0], 16)
    with pytest.raises(ValueError, match="advantages: expected 2"):
        L.build_packed_batches(p, c, [0.0], 16)
    with pytest.raises(ValueError, match=r"completion_ids\[0\]: expected a 1-D"):
        L.build_packed_batches(p, [[0.5], [1]], [0.0, 0.0], 16)
    with pytest.raises(ValueError, match="token_budget|max_tokens"):
        L.build_packed_batches(p, c, [0.0, 0.0], 0)
    b = L.build_packed_batches(p, c, [0.0, 0.0], 16)[0]
    with pytest.raises(ValueError, match="matches neither"):
        L.unpack(b, torch.zeros(b.num_completion_tokens + 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_min_micro_batches(backend, monkeypatch):
    if backend == "py":
        monkeypatch.setattr(_cext, "C", None)
    rng = random.Random(8)
    prompts, comps = _rollouts(rng, 30)
    total = sum(len(p) + len(c) for p, c in zip(prompts, comps))
    budget = max(len(p) + len(c) for p, c in zip(prompts, comps)) + total // 3
    assert len(L.build_packed_batches(prompts, comps, [0.0] * 30, budget)) < 7
    for m in (7, 12, 30):
        batches = L.build_packed_batches(prompts, comps, [0.0] * 30, budget, min_micro_batches=m,
                                         workload="attention", attn_coef=8.0)
        assert len(batches) == m and all(0 < b.num_tokens <= budget for b in batches)
        assert sorted(torch.cat([b.seq_index for b in batches]).tolist()) == list(range(30))
    # Balancing L² puts 4 + 5 + 6 = 15 tokens in one of 4 parts, over the budget of 14: FFD needs
    # 3 bins, KK over 4 parts overflows, so a fifth micro-batch is added.
    lens = [9, 5, 8, 4, 6, 9]
    tight = L.build_packed_batches([[1]] * 6, [[2] * (n - 1) for n in lens], [0.0] * 6, 14,
                                   min_micro_batches=4, workload="attention", attn_coef=0.0)
    assert len(tight) == 5 and max(b.num_tokens for b in tight) <= 14
    with pytest.raises(ValueError, match="min_micro_batches=31 > 30"):
        L.build_packed_batches(prompts, comps, [0.0] * 30, budget, min_micro_batches=31)
    with pytest.raises(ValueError, match="min_micro_batches=0"):
        L.build_packed_batches(prompts, comps, [0.0] * 30, budget, min_micro_batches=0)


def test_packed_batch_names_importable_from_packing():
    """The documented path (README): fastgrpo.packing exports PackedBatch and its builders (attribute,
    from-import and star import), the same objects as fastgrpo.packing.layout and fastgrpo's top level."""
    import fastgrpo
    import fastgrpo.packing as packing
    import fastgrpo.packing.layout as layout

    ns = {}
    exec("from fastgrpo.packing import *", ns)
    for name in ("PackedBatch", "build_packed_batches", "unpack", "shares_prefix", "plan_micro_batches"):
        assert getattr(packing, name) is ns[name]
    for name in ("PackedBatch", "build_packed_batches", "unpack", "shares_prefix"):
        assert getattr(packing, name) is getattr(layout, name)
    assert fastgrpo.PackedBatch is layout.PackedBatch and fastgrpo.unpack is layout.unpack
    with pytest.raises(AttributeError):
        packing.no_such_name
    with pytest.raises(AttributeError):  # no re-export shim in the bins module
        P.PackedBatch


@pytest.mark.parametrize("share", [False, True])
def test_packed_batches_hold_each_sequence_and_its_values(share):
    """Every micro-batch, shared or not, one or several per call: each sequence's prompt and
    completion tokens sit at their positions, each logit index predicts its target, and the
    per-token fields (gathered from one ragged array per field) are that sequence's values.
    Prompts come as G references to one list (converted once), as equal but distinct lists
    (still shared: grouping is by tokens) and as tensors."""
    rng = random.Random(5)
    prompts_u = [[rng.randrange(90) for _ in range(rng.randint(1, 6))] for _ in range(6)]
    prompts_u[3] = list(prompts_u[2])
    PR, C, A, M, O = [], [], [], [], []
    for k, p in enumerate(prompts_u):
        for g in range(4):
            c = 0 if (k, g) == (1, 2) else rng.randint(1, 9)
            PR.append(torch.tensor(p) if k == 5 else p)
            C.append([rng.randrange(90) for _ in range(c)])
            A.append(rng.uniform(-2, 2) if k != 4 else [rng.uniform(-2, 2) for _ in range(c)])
            M.append([rng.randint(0, 1) for _ in range(c)])
            O.append([rng.uniform(-5, 0) for _ in range(c)])
    for budget in (10_000, 40):  # one micro-batch (input order kept) and several (gathered)
        batches = L.build_packed_batches(PR, C, A, budget, completion_mask=M, old_logp=O, share_prefix=share,
                                       attn_coef=64.0, allow_oversize=True)
        assert sorted(i for b in batches for i in b.seq_index.tolist()) == list(range(len(PR)))
        assert (len(batches) > 1) == (budget == 40)
        for b in batches:
            ids, pos = b.input_ids.tolist(), b.position_ids.tolist()
            li, tg = b.logit_index.tolist(), b.targets.tolist()
            assert b.mask.nonzero()[:, 0].tolist() == sorted(x + 1 for x in li) or share
            n = 0
            for s, i in enumerate(b.seq_index.tolist()):
                p, c = list(map(int, PR[i])), C[i]
                assert b.prompt_lens[s] == len(p) and b.completion_lens[s] == len(c)
                assert tg[n:n + len(c)] == c
                for j in range(len(c)):
                    t = li[n + j] + 1 if j else None
                    if j:  # a completion token sits right after the one before it, at position P + j
                        assert ids[t] == c[j] and pos[t] == len(p) + j and b.mask[t]
                    first = li[n]  # the first token is predicted from the prompt's last token
                    assert ids[first] == p[-1] and pos[first] == len(p) - 1
                    assert ids[first - len(p) + 1:first + 1] == p
                adv = A[i] if isinstance(A[i], list) else [A[i]] * len(c)
                for name, want in (("advantages", adv), ("loss_mask", M[i]), ("old_logp", O[i])):
                    assert getattr(b, name)[n:n + len(c)].tolist() == torch.tensor(want, dtype=torch.float32).tolist()
                n += len(c)
            assert n == b.num_completion_tokens and (b.segment_prefix is not None) == share
        if share:
            one = L.build_packed_batches(PR, C, A, 10_000, share_prefix=True, attn_coef=64.0)[0]
            # equal-but-distinct prompt lists 2 and 3 form one group: one copy of the prompt
            assert one.num_tokens == sum(len(p) for k, p in enumerate(prompts_u) if k != 3) + sum(map(len, C))


def test_prompt_rows_made_on_each_read_keep_their_own_tokens():
    """A lazy sequence (an HF `datasets` column, a view) hands out a new list on every read: a
    freed row's id is reused by the next one, which must not be taken for the same prompt."""
    from fastgrpo.packing.layout import build_packed_batches

    rows = [[3 * i + 3, 3 * i + 4, 3 * i + 5] for i in range(64)]

    class Lazy:
        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            if i >= len(rows):
                raise IndexError(i)
            return list(rows[i])

    comps = [[1, 2]] * 64
    want = build_packed_batches(rows, comps, [0.0] * 64, 10 ** 6)[0]
    got = build_packed_batches(Lazy(), comps, [0.0] * 64, 10 ** 6)[0]
    assert torch.equal(got.input_ids, want.input_ids)
