"""Shared oracle-test helpers for the Triton kernel tests (house style rule 3): float64 ground
truth, the same-dtype torch reference, the kernel; the kernel's error may exceed the reference's
by at most one per-dtype tolerance. On failure the worst indices and values are printed."""
from __future__ import annotations

import torch

from fastgrpo.kernels.common import LossConfig

# Compiled kernels on a GPU machine, the interpreter on CPU (tests/conftest.py sets the flag).
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

# dtype → (atol, rtol) added on top of the same-dtype reference's own worst error. bf16/fp16
# gradients are stored in their dtype, so the kernel pays one rounding (2^-8 / 2^-11 relative).
TOL = {
    torch.float64: (1e-12, 1e-10),
    torch.float32: (2e-6, 2e-5),
    torch.float16: (2e-4, 2e-3),
    torch.bfloat16: (1e-3, 8e-3),
}


def check_vs_truth(name: str, kernel: torch.Tensor, ref: torch.Tensor, truth: torch.Tensor, dtype) -> None:
    """|kernel − truth| ≤ max|ref − truth| + atol + rtol·|truth| elementwise (a NaN fails)."""
    atol, rtol = TOL[dtype]
    k = kernel.detach().double().reshape(-1)
    t = truth.detach().double().reshape(-1)
    r = ref.detach().double().reshape(-1)
    assert k.shape == t.shape, f"{name}: shape {tuple(k.shape)} != truth {tuple(t.shape)}"
    if k.numel() == 0:
        return
    err_k = (k - t).abs()
    ref_err = (r - t).abs()
    ref_max = float(ref_err[torch.isfinite(ref_err)].max()) if bool(torch.isfinite(ref_err).any()) else 0.0
    bound = ref_max + atol + rtol * t.abs()
    bad = ~(err_k <= bound)
    if bool(bad.any()):
        excess = torch.where(bad, err_k - bound, torch.zeros_like(err_k)).nan_to_num(float("inf"))
        worst = excess.topk(min(5, int(bad.sum()))).indices
        lines = [f"  [{int(i)}] kernel={float(k[i]):.9g} truth={float(t[i]):.9g} ref={float(r[i]):.9g} "
                 f"err={float(err_k[i]):.3g} bound={float(bound[i]):.3g}" for i in worst]
        raise AssertionError(f"{name} ({dtype}): {int(bad.sum())}/{k.numel()} elements beyond the oracle bound "
                             f"(same-dtype reference max error {ref_max:.3g}); worst:\n" + "\n".join(lines))


def make_batch(n: int, v: int, seqlens, seed: int = 0, scale: float = 2.0, off_policy: float = 0.3):
    """Packed float64 inputs on DEV (drawn on CPU, so identical everywhere): logits, targets,
    advantages, mask (a fully masked sequence included), old/ref log-probs near the truth,
    weights, and cu_seqlens (CPU)."""
    g = torch.Generator().manual_seed(seed)
    assert sum(seqlens) == n
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * scale
    targets = torch.randint(0, v, (n,), generator=g)
    cu = torch.tensor([0] + list(seqlens)).cumsum(0)
    s = len(seqlens)
    adv_seq = torch.randn(s, generator=g, dtype=torch.float64)
    seq_ids = torch.repeat_interleave(torch.arange(s), torch.tensor(seqlens))
    advantages = adv_seq[seq_ids] if n else torch.zeros(0, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.25).double()
    if s >= 3:  # one fully masked sequence
        mask[cu[1]:cu[2]] = 0.0
    true_logp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    old = true_logp + off_policy * torch.randn(n, generator=g, dtype=torch.float64)
    ref = true_logp + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    out = dict(logits=logits, targets=targets, advantages=advantages, mask=mask, old_logp=old,
               ref_logp=ref, weights=weights)
    return {**{k: x.to(DEV) for k, x in out.items()}, "cu_seqlens": cu}


# Every option of the loss contract, each at least once (ids are the pytest ids).
LOSS_CASES = [
    ("default", LossConfig(), {}),
    ("dapo-clip-higher", LossConfig(eps_low=0.2, eps_high=0.28), {"old_logp"}),
    ("delta-dualclip-tau", LossConfig(delta=1.3, dual_clip_c=3.0, temperature=0.7), {"old_logp"}),
    ("k1-weights", LossConfig(beta=0.1, kl="k1"), {"old_logp", "ref_logp", "weights"}),
    ("k2-seqmean", LossConfig(beta=0.05, kl="k2", loss_agg="seq-mean-token-mean"), {"old_logp", "ref_logp"}),
    ("k3-ratiocorr-seqsum", LossConfig(beta=0.04, kl="k3", kl_ratio_correction=True,
                                       loss_agg="seq-mean-token-sum"), {"old_logp", "ref_logp"}),
    ("entropy-bonus", LossConfig(entropy_coef=0.01, temperature=1.3), {"old_logp"}),
    ("entropy-penalty-drgrpo", LossConfig(entropy_coef=-0.05, loss_agg="seq-mean-token-sum-norm", max_len=64),
     {"old_logp", "weights"}),
    ("gspo-sequence", LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4), {"old_logp"}),
    ("gspo-everything", LossConfig(ratio_level="sequence", beta=0.1, kl_ratio_correction=True, delta=2.0,
                                   dual_clip_c=2.5, entropy_coef=0.02, loss_agg="seq-mean-token-mean",
                                   temperature=0.9), {"old_logp", "ref_logp", "weights"}),
    ("num-items-onpolicy", LossConfig(), {"num_items"}),
]


def loss_kwargs(batch, uses, dtype):
    kw = dict(mask=batch["mask"], cu_seqlens=batch["cu_seqlens"])
    for key in ("old_logp", "ref_logp", "weights"):
        if key in uses:
            kw[key] = batch[key] if dtype == torch.float64 else batch[key].float()
    if "num_items" in uses:
        kw["num_items"] = 3 * batch["logits"].shape[0]
    return kw
