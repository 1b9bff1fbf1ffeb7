"""Fused lm_head + GRPO loss (kernels/fused_linear.py) vs the oracle on materialised logits:
loss, logp, entropy, metrics and the gradients of hidden, weight and bias."""
import pytest
import torch

from fastgrpo import loss as api
from fastgrpo.kernels.contract import LossConfig
from fastgrpo.kernels.fused_linear import default_chunk_size
from fastgrpo.loss import fused_linear_grpo_loss
from kernel_oracle import BACKEND, check_fused_linear, fused_linear_runner, loss_kwargs, make_linear

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CONFIGS = {
    "token-all": LossConfig(beta=0.05, kl_ratio_correction=True, delta=1.5, dual_clip_c=3.0, eps_high=0.28,
                            entropy_coef=0.01, temperature=0.8, loss_agg="seq-mean-token-mean"),
    "sequence-all": LossConfig(ratio_level="sequence", beta=0.05, entropy_coef=-0.02,
                               loss_agg="seq-mean-token-sum-norm", max_len=32),
    "token-plain": LossConfig(),
    "softcap": LossConfig(softcap=4.0, beta=0.05, entropy_coef=0.01, temperature=0.9),  # Gemma 2's head cap
}
USES = {"old_logp", "ref_logp", "weights"}


def run(fn, b, dtype, cfg, with_bias, **extra):
    """The backend's results alone (no oracle): for comparisons between its own runs."""
    return fused_linear_runner(fn, b, dtype, cfg, with_bias, USES, **extra)(BACKEND)


@pytest.mark.parametrize("impl", ["triton", "torch"])  # torch: the per-chunk CPU twin
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_fused_linear_vs_oracle(cfg_name, dtype, impl):
    cfg = CONFIGS[cfg_name]
    with_bias = cfg_name != "token-plain"
    b = make_linear(61, 24, 517, [20, 1, 15, 25], seed=len(cfg_name))
    check_fused_linear(fused_linear_grpo_loss, b, dtype, cfg, with_bias, USES, chunk_size=16, impl=impl)


def test_chunking_does_not_change_the_result_and_facade_dispatches():
    b = make_linear(50, 16, 300, [25, 25], seed=3)
    cfg = CONFIGS["token-all"]
    grads = ("d_hidden", "d_weight", "d_bias")
    base = run(fused_linear_grpo_loss, b, torch.float32, cfg, True, chunk_size=1, impl="triton")
    facade = lambda *a, **k: api.fused_linear_grpo_loss(*a, impl="triton", **k)  # noqa: E731
    for fn, chunk in ((fused_linear_grpo_loss, 7), (fused_linear_grpo_loss, 50), (fused_linear_grpo_loss, None),
                      (facade, 13)):
        out = run(fn, b, torch.float32, cfg, True, chunk_size=chunk, **({"impl": "triton"} if fn is not facade else {}))
        assert torch.allclose(out["loss"], base["loss"], atol=1e-6), chunk
        for key in grads:
            assert torch.allclose(out[key], base[key], atol=1e-6, rtol=1e-5), (chunk, key)


def test_frozen_weight_gets_no_gradient_and_only_hidden_is_computed():
    b = make_linear(20, 8, 64, [20], seed=4)
    hid = b["hidden"].float().requires_grad_(True)
    w = b["weight"].float()
    out = fused_linear_grpo_loss(hid, w, b["targets"], b["advantages"].float(), chunk_size=6, impl="triton")
    out.loss.backward()
    assert hid.grad is not None and torch.count_nonzero(hid.grad) > 0 and w.grad is None


def test_no_grad_scoring_matches_the_training_forward():
    b = make_linear(30, 8, 77, [12, 18], seed=5)
    cfg = CONFIGS["sequence-all"]
    kw = loss_kwargs(b, USES, torch.float32)
    args = (b["hidden"].float(), b["weight"].float(), b["targets"], b["advantages"].float())
    with torch.no_grad():
        scored = fused_linear_grpo_loss(*args, config=cfg, chunk_size=7, impl="triton", return_entropy=True, **kw)
    trained = fused_linear_grpo_loss(args[0].clone().requires_grad_(True), *args[1:], config=cfg, chunk_size=7,
                                     impl="triton", return_entropy=True, **kw)
    assert not scored.loss.requires_grad and trained.loss.requires_grad
    assert torch.equal(scored.loss, trained.loss.detach()) and torch.equal(scored.logp, trained.logp)
    assert torch.equal(scored.entropy, trained.entropy)
    assert scored.metrics.keys() == trained.metrics.keys()


def test_default_chunk_fits_the_budget():
    assert default_chunk_size(65536, 151936, torch.bfloat16, torch.device("cuda")) * 151936 * 2 <= 2 ** 30
    assert default_chunk_size(3, 151936, torch.bfloat16, torch.device("cuda")) == 3
    assert default_chunk_size(10 ** 6, 10 ** 8, torch.float32, torch.device("cpu")) == 128  # floor of 128 rows


@pytest.mark.parametrize("bad, match", [
    (dict(weight=torch.zeros(5, 3)), r"weight: expected a \[V, H=4\] tensor"),
    (dict(bias=torch.zeros(7)), r"bias: expected None or a tensor \[V=5\]"),
    (dict(bias=torch.zeros(5, dtype=torch.float64)), r"bias: expected None or a tensor \[V=5\] of dtype torch.float32"),
    (dict(chunk_size=0), "chunk_size: expected None or a positive int"),
    (dict(impl="cuda"), "impl='cuda': expected one of"),
    (dict(targets=torch.tensor([0, 1, 5])), r"targets: values must lie in \[0, V=5\)"),
    (dict(advantages=torch.zeros(2)), r"advantages: expected shape \[3\]"),
])
def test_bad_input_names_the_argument(bad, match):
    kw = dict(hidden=torch.zeros(3, 4), weight=torch.zeros(5, 4), targets=torch.tensor([0, 1, 4]),
              advantages=torch.zeros(3))
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        fused_linear_grpo_loss(**kw)
