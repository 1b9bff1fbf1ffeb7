"""The public loss facade (fastgrpo/loss.py): names, dispatch, bad input, degenerate batches.
Backends against the float64 oracle are tested in tests/kernels/ (one harness, kernel_oracle.py);
here only its input generator is borrowed."""
import functools
import os
import sys

import pytest
import torch

import fastgrpo
from fastgrpo.integrations.trl_config import trl_loss_config
from fastgrpo.loss import LossConfig, LossOutput, fused_linear_grpo_loss, grpo_loss, token_logprobs

# pytest puts only this file's own folder on sys.path; the harness lives in tests/kernels/
_KERNEL_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")
if _KERNEL_TESTS not in sys.path:
    sys.path.insert(0, _KERNEL_TESTS)
from kernel_oracle import make_batch  # noqa: E402

make_inputs = functools.partial(make_batch, device="cpu")  # the facade tests use CPU tensors


def _call(inp, **over):
    kw = dict(mask=inp["mask"], old_logp=inp["old_logp"], ref_logp=inp["ref_logp"], weights=inp["weights"],
              cu_seqlens=inp["cu_seqlens"], config=LossConfig(beta=0.1), impl="torch")
    kw.update(over)
    logits = over.pop("logits", inp["logits"])
    targets = over.pop("targets", inp["targets"])
    advantages = over.pop("advantages", inp["advantages"])
    for k in ("logits", "targets", "advantages"):
        kw.pop(k, None)
    return grpo_loss(logits, targets, advantages, **kw)


def test_public_names_and_output_types():
    assert fastgrpo.LossConfig is LossConfig and fastgrpo.LossOutput is LossOutput
    assert fastgrpo.grpo_loss is grpo_loss and fastgrpo.token_logprobs is token_logprobs
    assert fastgrpo.fused_linear_grpo_loss is fused_linear_grpo_loss
    inp = make_inputs(9, 13, dtype=torch.float32)
    logits = inp["logits"].requires_grad_(True)
    out = _call(inp, logits=logits, return_entropy=True)
    assert isinstance(out, LossOutput) and out.loss.dim() == 0 and out.loss.requires_grad
    assert out.logp.shape == (9,) and not out.logp.requires_grad and out.entropy.shape == (9,)
    assert {"clip_frac_low", "clip_frac_high", "ratio_mean", "ratio_min", "ratio_max", "kl_mean",
            "entropy_mean"} <= set(out.metrics)
    for v in out.metrics.values():
        assert v.dim() == 0 and not v.requires_grad and v.dtype == torch.float32
    assert _call(inp).entropy is None


def test_auto_is_torch_on_cpu():
    inp = make_inputs(10, 20)
    a = _call(inp, impl="auto")
    t = _call(inp, impl="torch")
    assert torch.equal(a.loss, t.loss) and torch.equal(a.logp, t.logp)


def test_masked_positions_may_hold_garbage():
    inp = make_inputs(20, 15, seed=2)
    for impl in ("reference", "torch"):
        clean = _call(inp, impl=impl, config=LossConfig(beta=0.1, ratio_level="sequence", kl_ratio_correction=True))
        off = inp["mask"] == 0
        dirty = dict(inp)
        for k, val in (("old_logp", -float("inf")), ("ref_logp", float("-inf")), ("weights", float("nan")),
                       ("advantages", float("nan"))):
            dirty[k] = inp[k].masked_fill(off, val)
        x = inp["logits"].clone().requires_grad_(True)
        out = _call(dirty, impl=impl, logits=x,
                    config=LossConfig(beta=0.1, ratio_level="sequence", kl_ratio_correction=True))
        out.loss.backward()
        assert torch.isfinite(out.loss) and bool(torch.isfinite(x.grad).all())
        torch.testing.assert_close(out.loss, clean.loss, rtol=0, atol=1e-12)
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values())


@pytest.mark.parametrize("impl", ["reference", "torch"])
def test_zero_tokens_and_zero_mask_give_zero_loss_and_grads(impl):
    for n, mask_zero in ((0, False), (6, True)):
        inp = make_inputs(n, 5)
        if mask_zero:
            inp["mask"] = torch.zeros(n, dtype=torch.bool)
        x = inp["logits"].clone().requires_grad_(True)
        for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            x.grad = None
            out = _call(inp, logits=x, impl=impl, config=LossConfig(beta=0.1, loss_agg=agg, max_len=4,
                                                                    entropy_coef=0.1))
            out.loss.backward()
            assert float(out.loss.detach()) == 0.0
            assert x.grad.shape == (n, 5) and torch.count_nonzero(x.grad) == 0


BAD = [
    (dict(logits=torch.zeros(4, 3, dtype=torch.int64)), "logits", "floating"),
    (dict(logits=torch.zeros(4)), "logits", r"\[N, V\]"),
    (dict(targets=torch.zeros(3, dtype=torch.int64)), "targets", "shape"),
    (dict(targets=torch.tensor([0, 1, 5, 0])), "targets", r"\[0, V=5\)"),
    (dict(targets=torch.tensor([0, -1, 2, 0])), "targets", r"\[0, V=5\)"),
    (dict(targets=torch.zeros(4)), "targets", "integer"),
    (dict(advantages=torch.zeros(5)), "advantages", "shape"),
    (dict(advantages=None), "advantages", "float tensor"),
    (dict(mask=torch.ones(3)), "mask", "shape"),
    (dict(old_logp=torch.zeros(4, dtype=torch.int64)), "old_logp", "floating"),
    (dict(cu_seqlens=torch.tensor([0, 3])), "cu_seqlens", "end at N=4"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 4])), "cu_seqlens", "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 4.0])), "cu_seqlens", "integer"),
    (dict(ref_logp=None), "ref_logp", "beta"),
    (dict(num_items=0), "num_items", "positive"),
    (dict(num_items=10, config=LossConfig(beta=0.1, loss_agg="seq-mean-token-sum")), "num_items", "token-mean"),
    (dict(config={"beta": 0.1}), "config", "LossConfig"),
    (dict(impl="cuda"), "impl", "one of"),
    (dict(old_logp=torch.tensor([0.0, float("nan"), 0.0, 0.0])), "old_logp", "non-finite"),
]


@pytest.mark.parametrize("over,name,expect", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_raises_value_error(over, name, expect):
    inp = make_inputs(4, 5)
    inp["mask"] = torch.ones(4)
    with pytest.raises(ValueError, match=f"{name}.*{expect}"):
        _call(inp, **over)


def test_config_validation():
    with pytest.raises(ValueError, match="max_len"):
        LossConfig(loss_agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), temperature=0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_logits_raise_by_default(bad, monkeypatch):
    inp = make_inputs(6, 7)
    inp["logits"][3, 2] = bad
    for impl in ("reference", "torch"):
        with pytest.raises(ValueError, match="logits: row 3 contains NaN or Inf"):
            _call(inp, impl=impl)
    with pytest.raises(ValueError, match="logits: row 3"):
        token_logprobs(inp["logits"], inp["targets"], impl="torch")
    monkeypatch.setenv("FASTGRPO_CHECK_FINITE", "0")
    assert not torch.isfinite(_call(inp).logp[3])  # the check is off: the NaN comes through


def test_triton_impl_on_cpu_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp = make_inputs(4, 5)
    with pytest.raises(ValueError, match="impl='triton'.*CUDA"):
        _call(inp, impl="triton")
    with pytest.raises(ValueError, match="impl='triton'.*CUDA"):
        token_logprobs(inp["logits"], inp["targets"], impl="triton")


def test_fused_linear_bad_input():
    h, w = torch.randn(4, 3), torch.randn(5, 3)
    t, a = torch.tensor([0, 1, 2, 4]), torch.zeros(4)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_grpo_loss(h, torch.randn(5, 2), t, a, impl="torch")
    with pytest.raises(ValueError, match="targets.*V=5"):
        fused_linear_grpo_loss(h, w, torch.tensor([0, 1, 2, 5]), a, impl="torch")
    with pytest.raises(ValueError, match="bias"):
        fused_linear_grpo_loss(h, w, t, a, bias=torch.zeros(4), impl="torch")
    with pytest.raises(ValueError, match="chunk_size"):
        fused_linear_grpo_loss(h, w, t, a, chunk_size=0, impl="torch")
    out = fused_linear_grpo_loss(h, w, t, a, impl="torch")
    assert float(out.loss.detach()) == 0.0 and out.logp.shape == (4,)


def test_trl_loss_config_mapping():
    s = trl_loss_config("dapo", epsilon=0.2, epsilon_high=0.28, num_items_in_batch=torch.tensor(1000.0),
                        num_processes=4, gradient_accumulation_steps=8, steps_per_generation=4)
    assert s.config.loss_agg == "token-mean" and s.config.eps_high == 0.28 and s.loss_scale == 1.0
    assert s.num_items == pytest.approx(1000 / 4 * 8 / 4)
    s = trl_loss_config("grpo", beta=0.04, gradient_accumulation_steps=4)
    assert s.config.loss_agg == "seq-mean-token-mean" and s.config.kl_ratio_correction and s.loss_scale == 0.25
    s = trl_loss_config("dr_grpo", max_completion_length=256, training=False, gradient_accumulation_steps=4)
    assert s.config.max_len == 256 and s.loss_scale == 1.0
    with pytest.raises(ValueError, match="num_items_in_batch"):
        trl_loss_config("dapo")
    with pytest.raises(ValueError, match="loss_type"):
        trl_loss_config("cispo")
    with pytest.raises(ValueError, match="entropy_coef"):
        trl_loss_config("grpo", entropy_coef=0.01)


def test_triton_dispatch_uses_the_shared_backend_signature(monkeypatch):
    """impl='triton' calls its backends with the keyword signature the torch backends share: with
    the torch backends standing in for the Triton modules the results must be identical."""
    import fastgrpo.loss as facade

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(facade, "_TRITON_MODULES", {
        "loss": ("fastgrpo.kernels.cpu_stream", "grpo_loss_torch"),
        "logprobs": ("fastgrpo.kernels.cpu_stream", "token_logprobs_torch")})
    inp = make_inputs(8, 6)
    assert torch.equal(_call(inp, impl="triton").loss, _call(inp, impl="torch").loss)
    lp, _ = token_logprobs(inp["logits"], inp["targets"], impl="triton")
    assert torch.equal(lp, token_logprobs(inp["logits"], inp["targets"], impl="torch")[0])
    monkeypatch.setattr(facade, "_TRITON_MODULES", {"loss": ("fastgrpo.kernels.no_such_module", "f")})
    with pytest.raises(RuntimeError, match="Triton backend fastgrpo.kernels.no_such_module.f is not available"):
        _call(inp, impl="triton")
    assert torch.equal(_call(inp, impl="auto").loss, _call(inp, impl="torch").loss)


@pytest.mark.parametrize("impl", ["reference", "torch"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_fractional_mask_summing_below_one_is_a_true_weighted_mean(impl, level, agg):
    """Masked means divide by the mask sum, not by max(sum, 1): one token weighted 0.5 has the
    same mean ratio, metrics and loss as the token weighted 1 (an empty mean stays 0)."""
    import math

    torch.manual_seed(0)
    x = torch.randn(1, 5, dtype=torch.float64)
    y = torch.tensor([2])
    old = (torch.log_softmax(x, -1)[0, 2] - math.log(5.815)).reshape(1)
    a = torch.ones(1, dtype=torch.float64)
    cfg = LossConfig(eps_high=10.0, ratio_level=level, loss_agg=agg)
    outs = [grpo_loss(x, y, a, mask=torch.tensor([m], dtype=torch.float64), old_logp=old, config=cfg, impl=impl)
            for m in (1.0, 0.5)]
    assert abs(float(outs[0].metrics["ratio_mean"]) - 5.815) < 1e-3
    for key in ("ratio_mean", "ratio_max"):
        assert abs(float(outs[1].metrics[key]) - float(outs[0].metrics[key])) < 1e-4, key
    assert abs(float(outs[1].loss) - float(outs[0].loss)) < 1e-9
