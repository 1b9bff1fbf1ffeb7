"""The vocabulary-streaming CPU path (kernels/torch_loss.py, torch_fused_linear.py) against the
float64 oracle (kernels/reference.py): loss, every gradient, log-probs, entropy, metrics."""
import pytest
import torch

from _loss_inputs import make_inputs
from fastgrpo.kernels import torch_loss
from fastgrpo.kernels.torch_loss import grpo_loss_torch
from fastgrpo.loss import LossConfig, fused_linear_grpo_loss, grpo_loss, token_logprobs

# The combinations that exercise distinct code: each clip / cap / KL / entropy / ratio level /
# aggregation appears at least once, several together in the last ones.
CONFIGS = {
    "default": LossConfig(),
    "clip-higher+delta": LossConfig(eps_low=0.2, eps_high=0.28, delta=1.5),
    "dual-clip": LossConfig(dual_clip_c=3.0, eps_low=0.1, eps_high=0.1),
    "k1": LossConfig(beta=0.1, kl="k1"),
    "k2-seqmean": LossConfig(beta=0.2, kl="k2", loss_agg="seq-mean-token-mean"),
    "k3-ratio-corr": LossConfig(beta=0.04, kl="k3", kl_ratio_correction=True, delta=2.0),
    "entropy-tau": LossConfig(entropy_coef=0.01, temperature=0.7, loss_agg="seq-mean-token-sum"),
    "gspo": LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "drgrpo-all": LossConfig(temperature=1.3, eps_high=0.28, delta=1.8, dual_clip_c=2.5, beta=0.05,
                             kl_ratio_correction=True, entropy_coef=-0.02, loss_agg="seq-mean-token-sum-norm",
                             max_len=50),
    "gspo-all": LossConfig(ratio_level="sequence", beta=0.1, kl="k2", kl_ratio_correction=True,
                           entropy_coef=0.05, loss_agg="token-mean"),
}


def run(impl, inp, config, use_weights=True, num_items=None, loss_scale=1.0, **kw):
    """impl "two-pass" is the torch backend with the gradient recomputed in the backward (the
    default for token-level ratios is the single-pass mode)."""
    logits = inp["logits"].clone().requires_grad_(True)
    args = (logits, inp["targets"], inp["advantages"])
    kwargs = dict(mask=inp["mask"], old_logp=inp["old_logp"], ref_logp=inp["ref_logp"],
                  weights=inp["weights"] if use_weights else None, cu_seqlens=inp["cu_seqlens"], config=config,
                  num_items=num_items, return_entropy=True, **kw)
    if impl == "two-pass":
        out = grpo_loss_torch(*args, single_pass=False, **kwargs)
    else:
        out = grpo_loss(*args, impl=impl, **kwargs)
    (out.loss * loss_scale).backward()
    return out, logits.grad


def assert_close(a, b, tol, what):
    a, b = a.detach(), b.detach()
    err = (a.double() - b.double()).abs()
    if err.numel() and float(err.max()) > tol:
        i = int(err.reshape(-1).argmax())
        raise AssertionError(f"{what}: max error {float(err.max()):.3e} > {tol:.1e} at flat index {i}: "
                             f"{float(a.reshape(-1)[i])} vs {float(b.reshape(-1)[i])}")


def compare(inp, config, tol=1e-10, impl="torch", **kw):
    ref, g_ref = run("reference", inp, config, **kw)
    out, g = run(impl, inp, config, **kw)
    assert_close(out.loss, ref.loss, tol, "loss")
    assert_close(g, g_ref, tol, "grad logits")
    assert_close(out.logp, ref.logp, tol, "logp")
    assert_close(out.entropy, ref.entropy, tol, "entropy")
    assert set(out.metrics) == set(ref.metrics)
    for k in ref.metrics:
        assert_close(out.metrics[k], ref.metrics[k], 1e-6, f"metric {k}")
    return out, g


@pytest.mark.parametrize("impl", ["torch", "two-pass"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_match_reference_fp64(name, impl, monkeypatch):
    # a 5-column vocabulary chunk forces the online log-sum-exp across many chunks, and a 3-row
    # single-pass block makes the objective run block by block
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "5")
    monkeypatch.setattr(torch_loss, "_FUSED_ELEMS", 3 * 23)
    inp = make_inputs(41, 23, seed=list(CONFIGS).index(name))
    out, g = compare(inp, CONFIGS[name], impl=impl, loss_scale=0.25)
    assert float(g.abs().max()) > 0  # the case has a gradient to compare


@pytest.mark.parametrize("n,v", [(1, 1), (1, 17), (7, 17), (123, 17), (7, 1), (3, 50000)])
def test_odd_sizes(n, v):
    inp = make_inputs(n, v, seed=n * 31 + v)
    for impl in ("torch", "two-pass"):
        compare(inp, CONFIGS["drgrpo-all"], impl=impl)
        compare(inp, CONFIGS["clip-higher+delta"], use_weights=False, impl=impl)


def test_single_pass_backward_twice_is_a_clear_error():
    inp = make_inputs(5, 7)
    x = inp["logits"].clone().requires_grad_(True)
    out = grpo_loss(x, inp["targets"], inp["advantages"], impl="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        out.loss.backward()


def test_num_items_overrides_denominator():
    inp = make_inputs(30, 11, seed=3)
    out, g = compare(inp, LossConfig(), num_items=1000)
    base, g_base = run("torch", inp, LossConfig())
    count = float(inp["mask"].sum())
    assert_close(out.loss * 1000 / count, base.loss, 1e-12, "num_items scaling")


def test_fully_masked_and_empty():
    inp = make_inputs(12, 9, seed=5)
    inp["mask"] = torch.zeros(12, dtype=torch.float64)
    for name in ("default", "drgrpo-all", "gspo-all"):
        out, g = run("torch", inp, CONFIGS[name])
        assert float(out.loss.detach()) == 0.0 and torch.isfinite(out.loss)
        assert torch.count_nonzero(g) == 0
    empty = make_inputs(0, 9)
    out, g = run("torch", empty, CONFIGS["drgrpo-all"])
    assert float(out.loss.detach()) == 0.0 and g.shape == (0, 9)
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("single_pass", [True, False])
def test_inplace_backward_writes_gradient_into_logits(single_pass):
    inp = make_inputs(40, 300, seed=7)
    cfg = CONFIGS["entropy-tau"]
    _, g_ref = run("reference", inp, cfg)
    base = inp["logits"].clone().requires_grad_(True)
    logits = base * 1.0  # non-leaf: the MulBackward node saves nothing, so the buffer may be reused
    out = grpo_loss_torch(logits, inp["targets"], inp["advantages"], mask=inp["mask"], old_logp=inp["old_logp"],
                          ref_logp=inp["ref_logp"], weights=inp["weights"], cu_seqlens=inp["cu_seqlens"],
                          config=cfg, inplace_backward=True, single_pass=single_pass)
    out.loss.backward()
    assert_close(base.grad, g_ref, 1e-10, "grad (in place)")
    assert_close(logits.detach(), g_ref, 1e-10, "logits buffer now holds the gradient")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_low_precision_inputs(dtype, tol, monkeypatch):
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "64")
    inp = make_inputs(50, 200, dtype=dtype, seed=11)
    cfg = CONFIGS["drgrpo-all"]
    ref_inp = dict(inp, logits=inp["logits"].double())  # the same (rounded) values in float64
    ref, g_ref = run("reference", ref_inp, cfg)
    for impl, inplace in (("torch", False), ("torch", True), ("two-pass", False), ("two-pass", True)):
        out, g = run(impl, inp, cfg, inplace_backward=inplace)
        assert g.dtype == dtype and out.logp.dtype == torch.float32
        assert_close(out.logp, ref.logp, 1e-5, "logp")  # float32 accumulation of exact inputs
        assert_close(out.entropy, ref.entropy, 1e-5, "entropy")
        assert_close(out.loss, ref.loss, 1e-5, "loss")
        # the gradient is rounded to the logits dtype on store: relative to its scale
        assert_close(g, g_ref, tol * float(g_ref.abs().max()), "grad logits")


@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_token_logprobs_and_entropy_gradient(tau, monkeypatch):
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "7")
    inp = make_inputs(20, 31, seed=13)
    w1, w2 = torch.randn(20, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
    grads = {}
    for impl in ("reference", "torch"):
        x = inp["logits"].clone().requires_grad_(True)
        logp, ent = token_logprobs(x, inp["targets"], temperature=tau, return_entropy=True, impl=impl)
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        grads[impl] = (logp.detach(), ent.detach(), x.grad)
    for a, b, what in zip(grads["torch"], grads["reference"], ("logp", "entropy", "grad")):
        assert_close(a, b, 1e-10, what)
    with torch.no_grad():
        logp, ent = token_logprobs(inp["logits"], inp["targets"], temperature=tau, impl="torch")
    assert ent is None and logp.shape == (20,) and not logp.requires_grad


@pytest.mark.parametrize("with_bias,chunk", [(False, None), (True, 3)])
def test_fused_linear_matches_reference(with_bias, chunk):
    g = torch.Generator().manual_seed(17)
    inp = make_inputs(13, 29, seed=17)
    hidden = torch.randn(13, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(29, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(29, generator=g, dtype=torch.float64) if with_bias else None
    cfg = CONFIGS["gspo-all"]
    res = {}
    for impl in ("reference", "torch"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        b = bias.clone().requires_grad_(True) if with_bias else None
        out = fused_linear_grpo_loss(h, w, inp["targets"], inp["advantages"], mask=inp["mask"],
                                     old_logp=inp["old_logp"], ref_logp=inp["ref_logp"], weights=inp["weights"],
                                     cu_seqlens=inp["cu_seqlens"], config=cfg, bias=b, chunk_size=chunk,
                                     impl=impl, return_entropy=True)
        out.loss.backward()
        res[impl] = [out.loss, out.logp, out.entropy, h.grad, w.grad] + ([b.grad] if with_bias else [])
    for a, b_, what in zip(res["torch"], res["reference"], ("loss", "logp", "entropy", "hidden", "weight", "bias")):
        assert_close(a, b_, 1e-10, what)


def test_strided_logits_view():
    # logits as a column-major view (e.g. a transposed matmul output): no contiguous copy needed
    inp = make_inputs(9, 40, seed=19)
    inp_t = dict(inp, logits=inp["logits"].t().contiguous().t())
    assert not inp_t["logits"].is_contiguous()
    for impl in ("torch", "two-pass"):
        for inplace in (False, True):
            compare(inp_t, CONFIGS["entropy-tau"], inplace_backward=inplace, impl=impl)


def test_leading_all_neg_inf_vocab_tile_gives_finite_logprobs():
    """A row whose first vocabulary tile is all −inf (masked-out vocabulary) must not turn the
    online log-sum-exp into NaN ((−inf) − (−inf))."""
    from fastgrpo.kernels.reference import token_logprobs_reference
    from fastgrpo.kernels.torch_loss import logprob_stats

    torch.manual_seed(0)
    x = torch.randn(5, 50, dtype=torch.float64)
    x[0, :20] = -float("inf")
    x[3, 16:] = -float("inf")
    y = torch.tensor([30, 1, 2, 3, 4])
    logp, _, _ = logprob_stats(x, y, 1.0, False, vocab_chunk=16)
    ref, _ = token_logprobs_reference(x, y)
    assert torch.isfinite(logp).all(), logp
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_inplace_backward_never_overwrites_a_leaf(ratio_level):
    from fastgrpo import LossConfig, grpo_loss
    from fastgrpo.kernels.reference import grpo_loss_reference

    torch.manual_seed(1)
    x = torch.randn(6, 33, dtype=torch.float64, requires_grad=True)
    before = x.detach().clone()
    y = torch.randint(0, 33, (6,))
    a = torch.randn(6, dtype=torch.float64)
    cfg = LossConfig(ratio_level=ratio_level)
    out = grpo_loss(x, y, a, config=cfg, inplace_backward=True)
    out.loss.backward()
    assert torch.equal(x.detach(), before)
    xr = before.clone().requires_grad_()
    grpo_loss_reference(xr, y, a, config=cfg).loss.backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-10)
