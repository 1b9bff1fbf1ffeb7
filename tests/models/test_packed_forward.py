"""Packed forward of tiny HF causal LMs (Llama, Qwen2; hidden 64, 2 layers, vocab 100, fixed
seed, fp32) against an ordinary right-padded batch: the same log-probs and gradients.

The packed (varlen SDPA buckets, other GEMM row counts) and the padded float32 forward round
differently, by amounts that depend on the CPU: both are held to the padded forward of the
float64 model, the packed one within the padded one's error + tol (model_oracle: tol = U ·
depth · magnitude). Paths that run the same ops on the same inputs are compared exactly."""
import copy
import random

import pytest
import torch

from fastgrpo.models.tiny import tiny_config
from fastgrpo.models.packed import VARLEN_ATTN, packed_forward, packed_logits, packed_logprobs
from fastgrpo.packing import build_packed_batches
from model_oracle import U, check_fp32, check_gemm, forward_depth, fp32_tol, train_depth

VOCAB = 100


def _model(arch, impl="sdpa"):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().eval()


def _padded_logprobs(model, prompts, comps, order):
    """Reference: one right-padded batch with an attention mask, log-probs of completion tokens."""
    seqs = [torch.cat([prompts[i], comps[i]]) for i in order]
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    att = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
        att[r, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=att).logits
    logp = (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(-1)
    out = []
    for r, i in enumerate(order):
        p, c = len(prompts[i]), len(comps[i])
        out.append(logp[r, p - 1:p + c - 1].gather(-1, comps[i][:, None])[:, 0])
    return torch.cat(out)


def _exact(model):
    return copy.deepcopy(model).double()


def _lp_tol(config, keys: int, zmax: float, lp: torch.Tensor) -> float:
    """A log-prob z_y − lse(z) moves by ≤ 2·max|dz| (the logits' bound: U · depth · max|z|), plus
    the log-sum-exp's float32 sum over the vocabulary and the roundings of lse and the result."""
    return 2 * U * forward_depth(config, keys) * zmax + U * (VOCAB + 2 * float(lp.abs().max()))


def _check_run(name, model, exact, prompts, comps, got, ref, truth, grads=None):
    """Log-probs (and, with grads = (got, ref, truth) dicts, every gradient) of the packed forward
    next to the padded float32 and float64 ones; `prompts` / `comps` in the batch's order."""
    keys = max(len(p) + len(c) for p, c in zip(prompts, comps))
    rows = sum(len(p) + len(c) for p, c in zip(prompts, comps))
    with torch.no_grad():
        zmax = max(float(exact(input_ids=torch.cat([p, c])[None]).logits.abs().max()) for p, c in zip(prompts, comps))
    check_fp32(f"{name}: log-probs", got, ref, truth, _lp_tol(model.config, keys, zmax, truth))
    depth = train_depth(model.config, keys, rows)
    for k in (grads[2] if grads else ()):
        check_fp32(f"{name}: grad {k}", grads[0][k], grads[1][k], grads[2][k], fp32_tol(depth, grads[2][k]))


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _cases():
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, VOCAB, (n,), generator=g)

    mixed_p, mixed_c = [5, 1, 7, 2, 3, 9], [6, 1, 2, 1, 11, 4]  # length-1 prompts/completions
    return {
        "mixed": ([toks(n) for n in mixed_p], [toks(n) for n in mixed_c], 64),
        "at_budget": ([toks(7), toks(3)], [toks(9), toks(13)], 16),  # each sequence exactly 16
        "one": ([toks(4)], [toks(5)], 9),  # a batch of one, at the budget
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["varlen", "mask"])
def test_packed_logprobs_and_grads_match_padded(arch, attn):
    model = _model(arch)
    exact = _exact(model)
    for name, (prompts, comps, budget) in _cases().items():
        batches = build_packed_batches(prompts, comps, [1.0] * len(prompts), budget)
        if name == "at_budget":
            assert len(batches) == 2 and all(b.num_tokens == budget for b in batches)
        for b in batches:
            order = b.seq_index.tolist()
            coef = torch.linspace(-1.0, 2.0, b.num_completion_tokens)
            model.zero_grad()
            lp = packed_logprobs(model, b, attn=attn)
            (lp * coef).sum().backward()
            g_packed = _grads(model)
            out = []
            for m in (model, exact):
                m.zero_grad()
                ref = _padded_logprobs(m, prompts, comps, order)
                (ref * coef.to(ref.dtype)).sum().backward()
                out.append((ref.detach(), _grads(m)))
            _check_run(name, model, exact, [prompts[i] for i in order], [comps[i] for i in order], lp, out[0][0],
                       out[1][0], (g_packed, out[0][1], out[1][1]))
    if attn == "varlen":
        # The model now dispatches to the varlen function, which is transformers' SDPA for
        # ordinary calls (the same call on the same inputs: bit-equal on any CPU): the padded
        # references above already ran through it; compare with an untouched model.
        assert model.config._attn_implementation == VARLEN_ATTN
        prompts, comps, _ = _cases()["mixed"]
        with torch.no_grad():
            assert torch.equal(_padded_logprobs(model, prompts, comps, range(6)),
                               _padded_logprobs(_model(arch), prompts, comps, range(6)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gradient_checkpointing(arch):
    """Checkpointed layers re-run during backward and must take the same varlen path."""
    model = _model(arch).train()
    exact = _exact(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    prompts, comps, _ = _cases()["mixed"]
    b = build_packed_batches(prompts, comps, [0.0] * len(prompts), 256)[0]
    coef = torch.linspace(-1.0, 2.0, b.num_completion_tokens)
    lp = packed_logprobs(model, b)
    (lp * coef).sum().backward()
    g_packed = _grads(model)
    model.zero_grad()
    model.gradient_checkpointing_disable()
    out = []
    for m in (model, exact):
        ref = _padded_logprobs(m, prompts, comps, b.seq_index.tolist())
        (ref * coef.to(ref.dtype)).sum().backward()
        out.append((ref.detach(), _grads(m)))
    order = b.seq_index.tolist()
    _check_run("checkpointed", model, exact, [prompts[i] for i in order], [comps[i] for i in order], lp, out[0][0],
               out[1][0], (g_packed, out[0][1], out[1][1]))


def test_packed_forward_rows_and_temperature():
    model = _model("qwen2", impl="eager")
    exact = _exact(model)
    prompts, comps, _ = _cases()["mixed"]
    b = build_packed_batches(prompts, comps, [0.0] * len(prompts), 256)[0]
    h = packed_forward(model, b)
    assert h.shape == (b.num_completion_tokens, 64)
    logits = packed_logits(model, b)
    assert logits.shape == (b.num_completion_tokens, VOCAB)
    # the lm_head on those rows (the same rows of the same forward): within γ_H·|h||W| of float64
    check_gemm("packed_logits", logits, h, model.lm_head.weight, model.lm_head.bias)
    # full-model logits at logit_index are the same rows (transformers detects packing from the
    # restarting position ids only without a KV cache: use_cache=False), both next to float64
    full = model(input_ids=b.input_ids[None], position_ids=b.position_ids[None], use_cache=False).logits[0]
    with torch.no_grad():
        truth = packed_logits(exact, b)
    depth = forward_depth(model.config, int(b.max_seqlen))
    check_fp32("full-model rows", logits, full[b.logit_index], truth, fp32_tol(depth, truth))
    lp2 = packed_logprobs(model, b, temperature=2.0)
    want = (logits.float() / 2.0).log_softmax(-1).gather(-1, b.targets[:, None])[:, 0]
    truth2 = (truth / 2.0).log_softmax(-1).gather(-1, b.targets[:, None])[:, 0]
    tol = _lp_tol(model.config, int(b.max_seqlen), float(truth.abs().max()) / 2, truth2)
    check_fp32("temperature 2", lp2, want, truth2, tol)
    assert model.config._attn_implementation == VARLEN_ATTN


def test_random_packing_matches_padded():
    model = _model("llama")
    exact = _exact(model)
    rng = random.Random(7)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (rng.randint(1, 10),), generator=g) for _ in range(12)]
    comps = [torch.randint(3, VOCAB, (rng.randint(1, 20),), generator=g) for _ in range(12)]
    with torch.no_grad():
        for b in build_packed_batches(prompts, comps, [0.0] * 12, 48):
            order = b.seq_index.tolist()
            ref = _padded_logprobs(model, prompts, comps, order)
            truth = _padded_logprobs(exact, prompts, comps, order)
            _check_run("random packing", model, exact, [prompts[i] for i in order], [comps[i] for i in order],
                       packed_logprobs(model, b), ref, truth)


@pytest.mark.parametrize("math_max", [None, 0, 10 ** 6])
@pytest.mark.parametrize("call_cost", [0, 10 ** 12, None])
def test_bucketed_varlen_matches_padded(monkeypatch, call_cost, math_max):
    """Sequences gathered into right-padded SDPA buckets (one bucket per length, everything in
    one bucket, the default cost model) give the padded batch's log-probs and gradients — with
    short buckets on the baddbmm/softmax path (default: L <= 64), all on SDPA, all on baddbmm."""
    import fastgrpo.models.packed as models

    if call_cost is not None:
        monkeypatch.setattr(models, "_CALL_COST", call_cost)
    if math_max is not None:
        monkeypatch.setattr(models, "_MATH_MAX_LEN", math_max)
    model = _model("qwen2").train()
    exact = _exact(model)
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    n = 10
    prompts = [torch.randint(3, VOCAB, (rng.randint(1, 30),), generator=g) for _ in range(n)]
    comps = [torch.randint(3, VOCAB, (rng.choice([1, 2, 40, 60]),), generator=g) for _ in range(n)]
    b = build_packed_batches(prompts, comps, [0.0] * n, 1024)[0]
    coef = torch.linspace(-1.0, 2.0, b.num_completion_tokens)
    lp = packed_logprobs(model, b)
    (lp * coef).sum().backward()
    plan = models._LAST_PLAN[0]
    lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
    sizes = [(b[2], b[3]) for b in plan.buckets]  # (q index, k index, rows, Lq, Lk, mask)
    assert sum(m for m, _ in sizes) == len(lens)
    if call_cost == 0:  # only equal lengths share a call
        assert len(sizes) == len(set(lens))
    elif call_cost == 10 ** 12:
        assert sizes == [(len(lens), max(lens))]
    else:  # the default model splits this spread of lengths (2..90) into a few calls
        assert 1 < len(sizes) < len(lens)
    # every packed token has exactly one slot in the padded buckets
    assert sorted(plan.unpad.tolist()) == sorted(set(plan.unpad.tolist()))
    g_packed = _grads(model)
    model.zero_grad()
    out = []
    for m in (model, exact):
        ref = _padded_logprobs(m, prompts, comps, b.seq_index.tolist())
        (ref * coef.to(ref.dtype)).sum().backward()
        out.append((ref.detach(), _grads(m)))
    order = b.seq_index.tolist()
    _check_run("buckets", model, exact, [prompts[i] for i in order], [comps[i] for i in order], lp, out[0][0],
               out[1][0], (g_packed, out[0][1], out[1][1]))


def test_bad_input():
    model = _model("llama")
    b = build_packed_batches([[3, 4]], [[5]], [0.0], 8)[0]
    with pytest.raises(ValueError, match="attn="):
        packed_forward(model, b, attn="flash")
    with pytest.raises(ValueError, match="PackedBatch"):
        packed_forward(model, {"input_ids": b.input_ids})
    with pytest.raises(ValueError, match="temperature"):
        packed_logprobs(model, b, temperature=0.0)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attn='mask'"):
        packed_forward(model, b)
    model.config._attn_implementation = "sdpa"
    from fastgrpo.models.packed import _varlen_sdpa_attention

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        _varlen_sdpa_attention(model.model.layers[0].self_attn, q, q, q, None, sliding_window=2,  # < 3 tokens
                               cu_seq_lens_q=torch.tensor([0, 3]))
    assert VARLEN_ATTN.startswith("fastgrpo")


def test_flash_branch_passes_varlen_kwargs(monkeypatch):
    """The GPU path cannot run here; check its plumbing instead: with the model configured for
    flash_attention_2, every attention call must receive int32 cu_seq_lens_q/k equal to the
    batch's cu_seqlens and integer max_length_q/k, and no mask — the inputs of transformers'
    padding-free flash-attn varlen branch. The flash function is stood in for by the CPU
    varlen attention, which reads the same kwargs, so the result must match padded too."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from fastgrpo.models.packed import _varlen_sdpa_attention

    seen = []

    def fake_flash(module, q, k, v, attention_mask, **kw):
        seen.append((attention_mask, kw["cu_seq_lens_q"], kw["cu_seq_lens_k"], kw["max_length_q"],
                     kw["max_length_k"]))
        return _varlen_sdpa_attention(module, q, k, v, attention_mask, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", fake_flash)
    assert "flash_attention_2" in AttentionMaskInterface._global_mapping
    model = _model("qwen2")
    model.config._attn_implementation = "flash_attention_2"
    prompts, comps, _ = _cases()["mixed"]
    b = build_packed_batches(prompts, comps, [0.0] * len(prompts), 256)[0]
    exact = _exact(model)
    exact.config._attn_implementation = "sdpa"
    with torch.no_grad():
        lp = packed_logprobs(model, b)
        model.config._attn_implementation = "sdpa"
        ref = _padded_logprobs(model, prompts, comps, b.seq_index.tolist())
        truth = _padded_logprobs(exact, prompts, comps, b.seq_index.tolist())
    assert len(seen) == model.config.num_hidden_layers
    for mask, cq, ck, mq, mk in seen:
        assert mask is None and cq.dtype == torch.int32 and torch.equal(cq, b.cu_seqlens) and torch.equal(ck, cq)
        assert mq == mk == b.max_seqlen and isinstance(mq, int)
    order = b.seq_index.tolist()
    _check_run("flash kwargs", model, exact, [prompts[i] for i in order], [comps[i] for i in order], lp, ref, truth)


def test_through_ddp_wrapper(tmp_path):
    """The forward goes through the wrapper (DDP's reducer must see it) and gives the same rows."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = _model("llama")
    prompts, comps, _ = _cases()["mixed"]
    b = build_packed_batches(prompts, comps, [0.0] * len(prompts), 256)[0]
    want = packed_logits(model, b).detach()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        calls = []
        ddp.register_forward_pre_hook(lambda mod, args: calls.append(1))
        got = packed_logits(ddp, b)
        got.sum().backward()
        # the wrapper runs the module's forward: the same ops on the same inputs, bit-equal
        assert calls == [1] and torch.equal(got, want)
        assert torch.equal(packed_forward(ddp, b), packed_forward(model, b))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["granite", "gemma2", "qwen2"])
def test_lm_head_logits_match_the_models_own_forward(arch):
    """The loss (hidden states → lm_head_logits) and old / reference scoring (packed_logits, the
    model's own forward) must see the same logits, also for models that post-process them
    (Granite logits_scaling, Gemma 2 final soft-capping); else the ratio is not 1 on-policy."""
    import transformers

    from fastgrpo.models.packed import lm_head_logits, packed_forward, packed_logits
    from fastgrpo.packing import build_packed_batches

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, intermediate_size=64, max_position_embeddings=128)
    if arch == "granite":
        cfg = transformers.GraniteConfig(logits_scaling=8.0, **common)
    elif arch == "gemma2":
        cfg = transformers.Gemma2Config(final_logit_softcapping=0.5, head_dim=16, **common)
    else:
        cfg = transformers.Qwen2Config(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    b = build_packed_batches([[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]], [1.0, -1.0], token_budget=64)[0]
    attn = "mask" if arch == "gemma2" else "auto"  # Gemma 2 has sliding-window layers
    exact = copy.deepcopy(model).double()
    with torch.no_grad():
        ours = lm_head_logits(model, packed_forward(model, b, attn=attn))
        theirs = packed_logits(model, b, attn=attn)
        truth = packed_logits(exact, b, attn=attn)
    # both float32 paths next to float64 (the post-processing is 1-Lipschitz: scaling down, tanh capping)
    check_fp32(arch, ours, theirs, truth, fp32_tol(forward_depth(model.config, 6), truth))
