"""Shared-prefix packing: a GRPO group's prompt carried once, its completions attending to it.
Log-probs and every parameter gradient must equal the unshared packed batch's (which
test_models.py checks against a padded batch), on Llama and Qwen2 with GQA, through both
attention paths of prefixed buckets (baddbmm / SDPA with a mask), with gradient checkpointing,
and with groups of one, empty completions and prompts that only look alike."""
import random

import pytest
import torch

from fastgrpo.models.tiny import tiny_config
from fastgrpo.models.packed import packed_forward, packed_logprobs
from fastgrpo.packing import build_packed_batches, unpack

VOCAB = 100
TOL = 1e-5


def _model(arch, kv_heads=1, heads=2):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=64 // heads)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def _groups(seed=0, n_groups=5, g=4):
    """Prompts repeated G times (GRPO groups), plus a group of one, an empty completion, and
    two different prompts of equal length."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)

    def toks(n):
        return torch.randint(3, VOCAB, (n,), generator=gen)

    prompts, comps = [], []
    for k in range(n_groups):
        p = toks(rng.randint(1, 12))
        for j in range(g):
            prompts.append(p.clone())
            comps.append(toks(0 if (k, j) == (1, 2) else rng.choice([1, 2, 5, 17, 40, 90])))
    prompts.append(toks(6))       # a group of one
    comps.append(toks(9))
    prompts.append(torch.tensor([7, 8, 9]))   # equal length, different tokens: not shared
    comps.append(toks(4))
    prompts.append(torch.tensor([7, 8, 10]))
    comps.append(toks(5))
    order = list(range(len(prompts)))
    rng.shuffle(order)            # members of a group need not be adjacent
    return [prompts[i] for i in order], [comps[i] for i in order]


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _run(model, batch, coef_by_seq):
    model.zero_grad()
    lp = packed_logprobs(model, batch)
    coef = torch.cat([coef_by_seq[int(i)][:int(c)] for i, c in zip(batch.seq_index, batch.completion_lens)])
    (lp * coef).sum().backward()
    per_seq = {int(i): x.detach() for i, x in zip(batch.seq_index, unpack(batch, lp))}
    return per_seq, _grads(model)


@pytest.mark.parametrize("arch, kv_heads, heads", [("qwen2", 1, 2), ("llama", 2, 4)])
@pytest.mark.parametrize("math_keys", [None, 0, 10 ** 6])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_equals_unshared(monkeypatch, arch, kv_heads, heads, math_keys, checkpointing):
    import fastgrpo.models.packed as models

    if math_keys is not None:
        monkeypatch.setattr(models, "_MATH_MAX_KEYS", math_keys)
    model = _model(arch, kv_heads, heads)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, comps = _groups()
    adv = [0.1 * i for i in range(len(prompts))]
    g = torch.Generator().manual_seed(5)
    coef = {i: torch.randn(len(c), generator=g) for i, c in enumerate(comps)}
    plain = build_packed_batches(prompts, comps, adv, 4096)
    shared = build_packed_batches(prompts, comps, adv, 4096, share_prefix=True)
    assert len(plain) == len(shared) == 1
    b = shared[0]
    assert b.segment_prefix is not None and b.num_tokens < plain[0].num_tokens
    distinct = {tuple(p.tolist()) for p in prompts}
    assert len(distinct) == 8   # five groups of 4, a group of one, two look-alike prompts
    saved = sum(len(p) for p in prompts) - sum(len(p) for p in distinct)
    assert plain[0].num_tokens - b.num_tokens == saved
    lp_a, g_a = _run(model, plain[0], coef)
    lp_b, g_b = _run(model, b, coef)
    plan = models._LAST_PLAN[0]
    assert plan.prefix is not None and any(bk[5] is not None for bk in plan.buckets)
    assert any(bk[5] is None for bk in plan.buckets)  # shared prompts and ungrouped sequences
    assert set(lp_a) == set(lp_b) == set(range(len(prompts)))
    for i in lp_a:
        assert lp_a[i].shape == lp_b[i].shape == (len(comps[i]),)
        if len(comps[i]):
            assert (lp_a[i] - lp_b[i]).abs().max() <= TOL, i
    assert set(g_a) == set(g_b)
    for k in g_a:
        assert (g_a[k] - g_b[k]).abs().max() <= TOL * max(1.0, g_a[k].abs().max().item()), k
    # completion-space fields follow the (regrouped) sequence order
    for s, i in enumerate(b.seq_index.tolist()):
        lo, hi = b.loss_cu_seqlens[s].item(), b.loss_cu_seqlens[s + 1].item()
        assert b.targets[lo:hi].tolist() == comps[i].tolist()
        assert torch.allclose(b.advantages[lo:hi], torch.full((hi - lo,), adv[i]))
        assert b.input_ids[b.logit_index[lo:hi] + 1].tolist()[1:] == comps[i].tolist()[1:]


def test_shared_layout_fields():
    p1, p2 = torch.tensor([5, 6, 7]), torch.tensor([9])
    c = [torch.tensor([11, 12]), torch.tensor([13]), torch.tensor([14, 15, 16]), torch.tensor([], dtype=torch.long)]
    b = build_packed_batches([p1, p2, p1, p1], c, [1.0, 2.0, 3.0, 4.0], 64, share_prefix=True)[0]
    # group p1 (sequences 0, 2, 3) first, then p2 (a group of one: an ordinary segment)
    assert b.seq_index.tolist() == [0, 2, 3, 1]
    assert b.input_ids.tolist() == [5, 6, 7, 11, 12, 14, 15, 16, 9, 13]
    assert b.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 0, 1]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 8, 10]
    assert b.segment_prefix.tolist() == [[0, 0], [0, 3], [0, 3], [0, 0]]
    assert b.max_seqlen == 6
    assert b.logit_index.tolist() == [2, 3, 2, 5, 6, 8]
    assert b.targets.tolist() == [11, 12, 14, 15, 16, 13]
    assert b.mask.nonzero()[:, 0].tolist() == [3, 4, 5, 6, 7, 9]
    assert b.completion_lens.tolist() == [2, 3, 0, 1] and b.prompt_lens.tolist() == [3, 3, 3, 1]
    assert b.advantages.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0, 2.0]


def test_shared_layout_refused_where_it_cannot_run():
    model = _model("qwen2")
    b = build_packed_batches([torch.tensor([5, 6])] * 2, [torch.tensor([7]), torch.tensor([8])], [0.0, 0.0], 64,
                             share_prefix=True)[0]
    with pytest.raises(ValueError, match="shared-prefix layout"):
        packed_forward(model, b, attn="mask")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="shared-prefix layout"):
        packed_forward(model, b)


def test_groups_share_only_where_the_cost_model_says_so():
    from fastgrpo.packing import shares_prefix

    assert shares_prefix(7, [27] * 8, attn_coef=384)          # the demo: short completions
    assert not shares_prefix(7, [100] * 8, attn_coef=384)     # long completions, short prompt
    assert not shares_prefix(50, [3], attn_coef=384)          # a group of one
    assert shares_prefix(7, [100] * 8, attn_coef=6 * 4096)    # a 7B-class model: dense layers dominate
    g = torch.Generator().manual_seed(2)
    pa, pb = torch.randint(3, VOCAB, (10,), generator=g), torch.randint(3, VOCAB, (2,), generator=g)
    comps = [torch.randint(3, VOCAB, (n,), generator=g) for n in (1, 2, 3, 20, 30)]
    prompts = [pa, pa, pa, pb, pb]
    # a = 1: group A (P 10, C 1,2,3): 2·110 > 14 shares; group B (P 2, C 20,30): 6 < 1300 does not
    b = build_packed_batches(prompts, comps, [0.5] * 5, 4096, share_prefix=True, attn_coef=1.0)[0]
    assert b.segment_prefix.tolist() == [[0, 0], [0, 10], [0, 10], [0, 10], [0, 0], [0, 0]]
    assert b.num_tokens == 10 + 6 + 22 + 32
    model = _model("qwen2")
    coef = {i: torch.ones(len(c)) for i, c in enumerate(comps)}
    lp_a, g_a = _run(model, build_packed_batches(prompts, comps, [0.5] * 5, 4096)[0], coef)
    lp_b, g_b = _run(model, b, coef)
    for i in lp_a:
        assert (lp_a[i] - lp_b[i]).abs().max() <= TOL
    for k in g_a:
        assert (g_a[k] - g_b[k]).abs().max() <= TOL * max(1.0, g_a[k].abs().max().item()), k


def test_malformed_segment_prefix_is_refused_and_plans_follow_the_prefix():
    import dataclasses

    import fastgrpo.models.packed as models

    model = _model("qwen2").eval()
    p = torch.tensor([5, 6, 7])
    b = build_packed_batches([p, p], [torch.tensor([8, 9]), torch.tensor([10])], [0.0, 0.0], 64,
                             share_prefix=True)[0]
    with torch.no_grad():
        ref = packed_logprobs(model, b)
    for bad, what in ((b.segment_prefix[:2], "rows"), (torch.tensor([[0, 0], [0, 3], [4, 2]]), "before its segment"),
                      (torch.tensor([[0, 0], [0, -1], [0, 3]]), "length >= 0")):
        with pytest.raises(ValueError, match=what):
            packed_forward(model, dataclasses.replace(b, segment_prefix=bad))
    # the plan is cached per forward: an in-place change of the prefix must rebuild it
    pre = b.segment_prefix.clone()
    b2 = dataclasses.replace(b, segment_prefix=pre)
    with torch.no_grad():
        assert torch.allclose(packed_logprobs(model, b2), ref, atol=TOL)
        pre[1] = torch.tensor([0, 2])  # the first completion's 2nd token is now predicted from 2 prompt tokens
        changed = packed_logprobs(model, b2)
    assert models._LAST_PLAN[0].prefix_version == pre._version
    assert not torch.allclose(changed, ref, atol=1e-4)


def test_bfloat16_shared_equals_unshared():
    """Half-precision models run every bucket on SDPA (float32 softmax): the shared layout
    agrees with the unshared one within bf16 rounding."""
    model = _model("qwen2").to(torch.bfloat16)
    prompts, comps = _groups(seed=4, n_groups=3, g=3)
    adv = [0.0] * len(prompts)
    with torch.no_grad():
        a = packed_logprobs(model, build_packed_batches(prompts, comps, adv, 4096)[0])
        b_ = build_packed_batches(prompts, comps, adv, 4096, share_prefix=True)[0]
        b = packed_logprobs(model, b_)
    plain = build_packed_batches(prompts, comps, adv, 4096)[0]
    a_by = {int(i): x for i, x in zip(plain.seq_index, unpack(plain, a))}
    assert b_.segment_prefix[:, 1].gt(0).any()
    for i, x in zip(b_.seq_index, unpack(b_, b)):
        assert x.dtype == torch.float32 and torch.isfinite(x).all()
        if len(x):  # measured: 0.004 at most (bf16 keeps ~3 significant digits of a log-prob ≈ -4.6)
            assert (x - a_by[int(i)]).abs().max() <= 0.03, int(i)
