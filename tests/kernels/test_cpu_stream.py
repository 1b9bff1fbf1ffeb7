"""The vocabulary-streaming CPU path (kernels/cpu_stream.py, and fused_linear.py's torch backend)
against the float64 oracle (kernels/reference.py) through the oracle harness (kernel_oracle.py):
loss, every gradient, log-probs, entropy, metrics."""
import functools

import pytest
import torch

from fastgrpo.kernels import cpu_stream
from fastgrpo.kernels.cpu_stream import grpo_loss_torch
from fastgrpo.kernels.reference import grpo_loss_reference
from fastgrpo.loss import LossConfig, fused_linear_grpo_loss, grpo_loss, token_logprobs
from kernel_oracle import (ALL_INPUTS, BACKEND, TRUTH, check_fused_linear, check_loss, check_vs_oracle,
                           check_vs_truth, logprobs_runner, loss_runner, make_batch, make_linear)

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
    # Gemma 2's final-logit soft cap (logits of std 2 against caps of 3–5: the tanh bends them)
    "softcap": LossConfig(softcap=5.0, eps_high=0.28, delta=1.5),
    "softcap-all": LossConfig(softcap=3.0, temperature=0.7, beta=0.05, kl="k3", entropy_coef=0.02,
                              loss_agg="seq-mean-token-sum"),
    "softcap-gspo": LossConfig(softcap=4.0, ratio_level="sequence", beta=0.1, entropy_coef=-0.03,
                               loss_agg="seq-mean-token-mean"),
}

CPU = torch.device("cpu")


def two_pass(*args, **kw):
    """The torch backend with the gradient recomputed in the backward (the default for
    token-level ratios is the single-pass mode)."""
    return grpo_loss_torch(*args, single_pass=False, **kw)


# "torch": through the facade (validation, dispatch, finiteness check), "two-pass": the backend
BACKENDS = {"torch": functools.partial(grpo_loss, impl="torch"), "two-pass": two_pass}


def check(impl, b, config, dtype=torch.float64, uses=ALL_INPUTS, **kw):
    """The backend `impl` ("torch" | "two-pass") through the oracle harness."""
    return check_loss(BACKENDS[impl], b, dtype, config, uses, **kw)


@pytest.mark.parametrize("impl", ["torch", "two-pass"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_match_reference_fp64(name, impl, monkeypatch):
    # a 5-column vocabulary chunk forces the online log-sum-exp across many chunks, and a 3-row
    # single-pass block makes the objective run block by block
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "5")
    monkeypatch.setattr(cpu_stream, "_FUSED_ELEMS", 3 * 23)
    b = make_batch(41, 23, seed=list(CONFIGS).index(name), device=CPU)
    out = check(impl, b, CONFIGS[name], loss_scale=0.25)
    assert float(out["d_logits"].abs().max()) > 0  # the case has a gradient to compare


@pytest.mark.parametrize("n,v", [(1, 1), (1, 17), (7, 17), (123, 17), (7, 1), (3, 50000)])
def test_odd_sizes(n, v):
    b = make_batch(n, v, seed=n * 31 + v, device=CPU)
    for impl in ("torch", "two-pass"):
        check(impl, b, CONFIGS["drgrpo-all"])
        check(impl, b, CONFIGS["clip-higher+delta"], uses={"old_logp", "ref_logp"})
        check(impl, b, CONFIGS["softcap-all"])


def test_single_pass_backward_twice_is_a_clear_error():
    b = make_batch(5, 7, device=CPU)
    x = b["logits"].clone().requires_grad_(True)
    out = grpo_loss(x, b["targets"], b["advantages"], impl="torch")
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward called twice"):
        out.loss.backward()


def test_num_items_overrides_denominator():
    b = make_batch(30, 11, seed=3, device=CPU)
    out = check("torch", b, LossConfig(), num_items=1000)
    base = loss_runner(BACKENDS["torch"], b, torch.float64, LossConfig())(BACKEND)
    count = float(b["mask"].sum())
    torch.testing.assert_close(out["loss"] * 1000 / count, base["loss"], rtol=0, atol=1e-12)


def test_fully_masked_and_empty():
    b = make_batch(12, 9, seed=5, device=CPU)
    b["mask"] = torch.zeros(12, dtype=torch.float64)
    for name in ("default", "drgrpo-all", "gspo-all"):
        out = loss_runner(BACKENDS["torch"], b, torch.float64, CONFIGS[name])(BACKEND)
        assert float(out["loss"]) == 0.0 and torch.isfinite(out["loss"])
        assert torch.count_nonzero(out["d_logits"]) == 0
    empty = make_batch(0, 9, device=CPU)
    out = loss_runner(BACKENDS["torch"], empty, torch.float64, CONFIGS["drgrpo-all"])(BACKEND)
    assert float(out["loss"]) == 0.0 and out["d_logits"].shape == (0, 9)
    assert all(torch.isfinite(v) for k, v in out.items() if k.startswith("metric"))


@pytest.mark.parametrize("cfg_name", ["entropy-tau", "softcap-all"])
@pytest.mark.parametrize("single_pass", [True, False])
def test_inplace_backward_writes_gradient_into_logits(single_pass, cfg_name):
    b = make_batch(40, 300, seed=7, device=CPU)
    cfg = CONFIGS[cfg_name]
    truth = loss_runner(grpo_loss_reference, b, torch.float64, cfg)(TRUTH)["d_logits"]
    base = b["logits"].clone().requires_grad_(True)
    logits = base * 1.0  # non-leaf: the MulBackward node saves nothing, so the buffer may be reused
    out = grpo_loss_torch(logits, b["targets"], b["advantages"], mask=b["mask"], old_logp=b["old_logp"],
                          ref_logp=b["ref_logp"], weights=b["weights"], cu_seqlens=b["cu_seqlens"],
                          config=cfg, inplace_backward=True, single_pass=single_pass)
    out.loss.backward()
    check_vs_truth("d_logits (in place)", base.grad, None, truth, torch.float64, gradient=True)
    assert torch.equal(logits.detach(), base.grad), "the logits buffer must now hold the gradient"
    # and the same through the harness's in-place run (every output, not only the gradient)
    check_loss(functools.partial(grpo_loss_torch, single_pass=single_pass), b, torch.float64, cfg, inplace=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_low_precision_inputs(dtype, monkeypatch):
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "64")
    b = make_batch(50, 200, seed=11, device=CPU)
    for impl in ("torch", "two-pass"):
        for inplace in (False, True):
            check(impl, b, CONFIGS["drgrpo-all"], dtype, inplace=inplace)
            check(impl, b, CONFIGS["softcap-all"], dtype, inplace=inplace)


@pytest.mark.parametrize("tau,softcap", [(1.0, None), (0.6, None), (0.8, 3.0)])
def test_token_logprobs_and_entropy_gradient(tau, softcap, monkeypatch):
    monkeypatch.setenv("FASTGRPO_VOCAB_CHUNK", "7")
    b = make_batch(20, 31, seed=13, device=CPU)
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(20, generator=g, dtype=torch.float64), torch.randn(20, generator=g, dtype=torch.float64))
    torch_impl = functools.partial(token_logprobs, impl="torch")
    check_vs_oracle(logprobs_runner(torch_impl, b["logits"], b["targets"], tau, grad_weights=w, softcap=softcap),
                    torch.float64)
    with torch.no_grad():
        logp, ent = token_logprobs(b["logits"], b["targets"], temperature=tau, impl="torch")
    assert ent is None and logp.shape == (20,) and not logp.requires_grad


@pytest.mark.parametrize("name", ["gspo-all", "softcap-all", "softcap-gspo"])
@pytest.mark.parametrize("with_bias,chunk", [(False, None), (True, 3)])
def test_fused_linear_matches_reference(with_bias, chunk, name):
    b = make_linear(13, 8, 29, seed=17, device=CPU)
    check_fused_linear(fused_linear_grpo_loss, b, torch.float64, CONFIGS[name], with_bias, chunk_size=chunk,
                       impl="torch")


def test_strided_logits_view():
    # logits as a column-major view (e.g. a transposed matmul output): no contiguous copy needed
    b = make_batch(9, 40, seed=19, device=CPU)
    b["logits"] = b["logits"].t().contiguous().t()
    assert not b["logits"].is_contiguous() and not b["logits"].clone().is_contiguous()
    for impl in ("torch", "two-pass"):
        for inplace in (False, True):
            check(impl, b, CONFIGS["entropy-tau"], inplace=inplace)


def test_leading_all_neg_inf_vocab_tile_gives_finite_logprobs():
    """A row whose first vocabulary tile is all −inf (masked-out vocabulary) must not turn the
    online log-sum-exp into NaN ((−inf) − (−inf))."""
    from fastgrpo.kernels.reference import token_logprobs_reference
    from fastgrpo.kernels.cpu_stream import logprob_stats

    torch.manual_seed(0)
    x = torch.randn(5, 50, dtype=torch.float64)
    x[0, :20] = -float("inf")
    x[3, 16:] = -float("inf")
    y = torch.tensor([30, 1, 2, 3, 4])
    logp, _, _ = logprob_stats(x, y, 1.0, False, vocab_chunk=16)
    ref, _ = token_logprobs_reference(x, y)
    assert torch.isfinite(logp).all(), logp
    check_vs_truth("logp", logp, None, ref, torch.float64)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_inplace_backward_never_overwrites_a_leaf(ratio_level):
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
    check_vs_truth("d_logits", x.grad, None, xr.grad, torch.float64, gradient=True)


def test_softcap_config_and_facade_checks():
    """softcap None / 0 is off (one spelling), a positive cap is kept as a float, anything else is
    refused naming the field; the facade's token_logprobs validates it the same way."""
    assert LossConfig(softcap=0).softcap is None and LossConfig(softcap=0) == LossConfig()
    assert LossConfig(softcap=30).softcap == 30.0
    for bad in (-1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="LossConfig.softcap="):
            LossConfig(softcap=bad)
    b = make_batch(6, 11, seed=2, device=CPU)
    with pytest.raises(ValueError, match="LossConfig.softcap=-2"):
        token_logprobs(b["logits"], b["targets"], softcap=-2.0, impl="torch")
    off, _ = token_logprobs(b["logits"], b["targets"], softcap=0, impl="torch")
    assert torch.equal(off, token_logprobs(b["logits"], b["targets"], impl="torch")[0])


def test_softcap_float32_matches_the_models_own_capped_logits_bit_for_bit():
    """The CPU path caps in transformers' op order (divide, tanh, multiply) in float32: its
    log-probs of raw logits equal those of the same path on logits capped by the model's head,
    and a cap changes the result (logits of std 2 against a cap of 3)."""
    b = make_batch(64, 300, seed=4, device=CPU, dtype=torch.float32)
    z, y = b["logits"], b["targets"]
    capped_by_model = torch.tanh(z / 3.0) * 3.0  # Gemma2ForCausalLM.forward's three ops
    for tau in (1.0, 0.7):
        mine, _ = token_logprobs(z, y, tau, softcap=3.0, impl="torch")
        theirs, _ = token_logprobs(capped_by_model, y, tau, impl="torch")
        assert torch.equal(mine, theirs)
        assert float((mine - token_logprobs(z, y, tau, impl="torch")[0]).abs().max()) > 1e-2
