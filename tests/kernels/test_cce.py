"""The single-kernel fused lm_head + loss (impl="cce", kernels/triton/fused_linear.py) vs the
float64 oracle on materialised logits, under TRITON_INTERPRET=1: loss, logp, entropy, metrics
and the gradients of hidden, weight and bias, token- and sequence-level ratios; odd sizes
(N, V, H not multiples of the tiles)."""
import pytest
import torch

from fastgrpo.kernels.contract import LossConfig
from fastgrpo.loss import fused_linear_grpo_loss
from kernel_oracle import check_fused_linear, make_linear

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CONFIGS = {
    "token-all": LossConfig(beta=0.05, kl_ratio_correction=True, delta=1.5, dual_clip_c=3.0, eps_high=0.28,
                            entropy_coef=0.01, temperature=0.8, loss_agg="seq-mean-token-mean"),
    "sequence-all": LossConfig(ratio_level="sequence", beta=0.05, entropy_coef=-0.02,
                               loss_agg="seq-mean-token-sum-norm", max_len=32),
    "token-plain": LossConfig(),
    "softcap": LossConfig(softcap=4.0, beta=0.05, entropy_coef=0.01, temperature=0.9),  # Gemma 2's head cap
    "softcap-sequence": LossConfig(softcap=2.5, ratio_level="sequence", loss_agg="seq-mean-token-mean"),
}
USES = {"old_logp", "ref_logp", "weights"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_cce_vs_oracle(cfg_name, dtype):
    cfg = CONFIGS[cfg_name]
    b = make_linear(61, 24, 517, [20, 1, 15, 25], seed=len(cfg_name))  # V = 517: a partial last tile
    check_fused_linear(fused_linear_grpo_loss, b, dtype, cfg, cfg_name != "token-plain", USES, impl="cce")


def test_cce_small_and_masked():
    b = make_linear(7, 40, 33, [3, 1, 0, 3], seed=9)  # H = 40: two hidden steps, one partial
    check_fused_linear(fused_linear_grpo_loss, b, torch.float32, CONFIGS["token-all"], True, USES, impl="cce")


def test_cce_refuses_float64_naming_hidden():
    b = make_linear(5, 8, 16, [5], seed=1)
    h, w = b["hidden"].double(), b["weight"].double()
    with pytest.raises(ValueError, match="hidden: impl='cce'"):
        fused_linear_grpo_loss(h, w, b["targets"], b["advantages"].double(), impl="cce")
