"""The one oracle harness for every loss backend (house style rule 3, after Apple's Cut
Cross-Entropy): float64 ground truth, the same-dtype torch reference, the backend; the backend's
error may exceed the reference's by at most one per-dtype tolerance (TOL). On failure the worst
indices and values are printed. Not a test module: the kernel tests import it by basename, and
tests/test_loss.py puts this folder on sys.path for its input generator.

API: make_batch / make_linear draw the inputs; check_vs_truth(name, kernel, ref, truth, dtype)
is the rule on one tensor; check_vs_oracle(run, dtype) applies it to every named result of a
backend call, where run(mode) performs that call as TRUTH, REFERENCE or BACKEND;
loss_runner / fused_linear_runner / logprobs_runner build `run` for the three kinds of backend,
and check_loss / check_fused_linear are the one-line forms.

The three runs see the same inputs, rounded once to the backend's dtype:
- TRUTH:     the float64 reference on those rounded inputs (input rounding is no one's error);
- REFERENCE: the torch reference at the backend's compute precision (float32 for bf16/fp16/fp32
             inputs, float64 for float64), its gradients rounded to the input dtype as the
             backend's are (skipped for float64: the truth is its own reference);
- BACKEND:   the function under test.
"""
from __future__ import annotations

import torch

from fastgrpo.kernels.contract import LossConfig
from fastgrpo.kernels.reference import grpo_loss_reference, token_logprobs_reference

# Compiled kernels on a GPU machine, the interpreter on CPU (tests/conftest.py sets the flag).
DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

# dtype → (atol, rtol) added on top of the same-dtype reference's own worst error, keyed by the
# precision a result carries: a gradient its stored dtype (bf16/fp16 gradients pay one rounding,
# 2^-8 / 2^-11 relative), the other results the precision they are computed at (float32 for
# bf16/fp16 logits, which every backend upcasts on load). For a gradient, atol is scaled by
# min(1, max|truth|): a token-mean loss's gradient is O(1/N), and an absolute bf16 floor of 1e-3
# is 13 % of the largest entry of the CPU stream test's gradient (max 0.0078). float64: 50× the
# worst excess measured on CPU (1.9e-15 beyond 1e-13·|truth|, Triton log-probs, interpreter).
TOL = {
    torch.float64: (1e-13, 1e-13),
    torch.float32: (2e-6, 2e-5),
    torch.float16: (2e-4, 2e-3),
    torch.bfloat16: (1e-3, 8e-3),
}

TRUTH, REFERENCE, BACKEND = "truth", "reference", "backend"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision every backend computes in (the loss contract): float64 stays, the rest is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_vs_truth(name: str, kernel: torch.Tensor, ref, truth: torch.Tensor, dtype, gradient: bool = False) -> None:
    """|kernel − truth| ≤ max|ref − truth| + atol·s + rtol·|truth| elementwise (a NaN fails), with
    (atol, rtol) = TOL[dtype] and s = min(1, max|truth|) for a `gradient` (1 if its truth is all
    zero, as at V = 1), else 1.
    `ref=None`: the truth is its own reference (a float64 backend, or an exact transcription)."""
    atol, rtol = TOL[dtype]
    k = kernel.detach().double().reshape(-1)
    t = truth.detach().double().reshape(-1)
    r = t if ref is None else ref.detach().double().reshape(-1)
    assert k.shape == t.shape, f"{name}: shape {tuple(k.shape)} != truth {tuple(t.shape)}"
    if k.numel() == 0:
        return
    err_k = (k - t).abs()
    ref_err = (r - t).abs()
    ref_max = float(ref_err[torch.isfinite(ref_err)].max()) if bool(torch.isfinite(ref_err).any()) else 0.0
    t_max = float(t.abs().max())
    scale = min(1.0, t_max) if gradient and t_max > 0 else 1.0  # an all-zero truth (V = 1) has no scale
    bound = ref_max + atol * scale + rtol * t.abs()
    bad = ~(err_k <= bound)
    if bool(bad.any()):
        excess = torch.where(bad, err_k - bound, torch.zeros_like(err_k)).nan_to_num(float("inf"))
        worst = excess.topk(min(5, int(bad.sum()))).indices
        shape = tuple(kernel.shape)
        lines = [f"  [{', '.join(map(str, _unravel(int(i), shape)))}] kernel={float(k[i]):.9g} "
                 f"truth={float(t[i]):.9g} ref={float(r[i]):.9g} err={float(err_k[i]):.3g} "
                 f"bound={float(bound[i]):.3g}" for i in worst]
        raise AssertionError(f"{name} ({dtype}): {int(bad.sum())}/{k.numel()} elements beyond the oracle bound "
                             f"(same-dtype reference max error {ref_max:.3g}); worst:\n" + "\n".join(lines))


def _unravel(i: int, shape) -> list:
    out = []
    for d in reversed(shape):
        out.append(i % d)
        i //= d
    return out[::-1]


def check_vs_oracle(run, dtype, value_dtype=None) -> dict:
    """The rule for one backend call. `run(mode)`, mode TRUTH | REFERENCE | BACKEND, returns the
    named results of that run ({"loss": …, "d_logits": …}; None where absent; names starting
    with "d_" are gradients). Every backend result must have the reference's dtype (a bf16
    gradient, float32 log-probs) and lie within the bound of check_vs_truth: gradients at
    TOL[dtype], the rest at TOL[value_dtype], by default the compute precision (float32 unless
    float64); a fused lm_head rounds its logits to `dtype` and passes value_dtype=dtype.
    Returns the backend's results."""
    value_dtype = value_dtype or compute_dtype(dtype)
    truth = run(TRUTH)
    ref = truth if dtype == torch.float64 else run(REFERENCE)
    out = run(BACKEND)
    assert set(out) == set(truth), f"result names {sorted(out)} != the oracle's {sorted(truth)}"
    for key in truth:
        if truth[key] is None or out[key] is None:
            assert truth[key] is None and out[key] is None, f"{key}: backend {out[key]!r}, oracle {truth[key]!r}"
            continue
        assert out[key].dtype == ref[key].dtype, f"{key}: dtype {out[key].dtype}, expected {ref[key].dtype}"
        grad = key.startswith("d_")
        check_vs_truth(key, out[key], None if ref is truth else ref[key], truth[key],
                       dtype if grad else value_dtype, gradient=grad)
    return out


def loss_results(out, grads: dict) -> dict:
    """A LossOutput and named gradients as check_vs_oracle's results (metrics as "metric <key>")."""
    res = dict(loss=out.loss.detach(), logp=out.logp, entropy=out.entropy, **grads)
    res.update({f"metric {k}": v for k, v in out.metrics.items()})
    return res


def make_batch(n: int, v: int, seqlens=None, *, seed: int = 0, dtype=torch.float64, scale: float = 2.0,
               shift: float = 0.0, spread: float = 0.3, fully_masked: bool = True, device=DEV) -> dict:
    """Packed inputs drawn on CPU (identical everywhere), then moved to `device` (cu_seqlens stays
    on CPU): logits [N, V] = randn·scale + shift rounded to `dtype`, targets, per-token
    advantages, a 75 % mask, old/ref log-probs within `spread` of the current policy (so the
    ratios straddle the clip bounds), weights in [0.5, 1.5), cu_seqlens. `seqlens` None: an
    empty sequence, a length-1 one, then the rest in four. With ≥ 3 sequences the last non-empty
    one is fully masked (unless `fully_masked=False`); at least one token is always on."""
    g = torch.Generator().manual_seed(seed)
    if seqlens is None:
        rest = max(n - 1, 0)
        k = max(1, min(4, rest))
        cuts = [0, 0, min(n, 1)] + [1 + (rest * i) // k if n else 0 for i in range(1, k + 1)]
        seqlens = [b - a for a, b in zip(cuts[:-1], cuts[1:])]
    assert sum(seqlens) == n, (seqlens, n)
    cu = torch.tensor([0] + list(seqlens), dtype=torch.int64).cumsum(0)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * scale + shift).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.25).double()
    nonempty = [i for i, s in enumerate(seqlens) if s]
    if fully_masked and len(seqlens) >= 3 and nonempty:
        i = nonempty[-1]
        mask[int(cu[i]):int(cu[i + 1])] = 0.0
    if n and not bool(mask.any()):
        mask[0] = 1.0  # at least one token on (N = 1 batches included), or there is nothing to compare
    logp = _target_logp(logits, targets) if n and v else torch.zeros(n, dtype=torch.float64)
    old = logp + spread * torch.randn(n, generator=g, dtype=torch.float64)
    ref = logp + spread * torch.randn(n, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    out = dict(logits=logits, targets=targets, advantages=adv, mask=mask, old_logp=old, ref_logp=ref,
               weights=weights)
    return {**{k: x.to(device) for k, x in out.items()}, "cu_seqlens": cu}


def make_linear(n: int, h: int, v: int, seqlens=None, *, seed: int = 0, device=DEV) -> dict:
    """make_batch plus lm_head inputs: hidden [N, H], weight [V, H] (logits of std ≈ 3), bias [V];
    "logits" and the old/ref log-probs follow hidden @ weightᵀ + bias."""
    b = make_batch(n, v, seqlens, seed=seed, device=device)
    g = torch.Generator().manual_seed(seed + 100)
    b["hidden"] = torch.randn(n, h, generator=g, dtype=torch.float64).to(device)
    b["weight"] = (torch.randn(v, h, generator=g, dtype=torch.float64) / h ** 0.5 * 3).to(device)
    b["bias"] = (torch.randn(v, generator=g, dtype=torch.float64) * 0.5).to(device)
    # the policy is now hidden @ weightᵀ + bias: move old/ref log-probs along (same noise)
    z = b["hidden"] @ b["weight"].t() + b["bias"]
    for key in ("old_logp", "ref_logp"):
        b[key] = b[key] + _target_logp(z, b["targets"]) - _target_logp(b["logits"], b["targets"])
    b["logits"] = z
    return b


def _target_logp(logits, targets):
    return torch.log_softmax(logits.double(), -1).gather(1, targets[:, None]).squeeze(1)


ALL_INPUTS = frozenset({"old_logp", "ref_logp", "weights"})

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
    # Gemma 2's final-logit soft cap; a cap of 3–5 against logits of std 2 bends most of them
    ("softcap", LossConfig(softcap=5.0, eps_high=0.28), {"old_logp"}),
    ("softcap-kl-entropy-tau", LossConfig(softcap=3.0, beta=0.05, entropy_coef=0.01, temperature=0.7,
                                          loss_agg="seq-mean-token-mean"), {"old_logp", "ref_logp", "weights"}),
    ("softcap-gspo", LossConfig(softcap=4.0, ratio_level="sequence", eps_low=3e-4, eps_high=4e-4,
                                entropy_coef=-0.02), {"old_logp"}),
]


def loss_kwargs(batch, uses, dtype):
    """The optional loss inputs named in `uses`, float32 unless `dtype` is float64 (as a trainer
    passes them): every run of one check gets these same values."""
    kw = dict(mask=batch["mask"], cu_seqlens=batch["cu_seqlens"])
    for key in ("old_logp", "ref_logp", "weights"):
        if key in uses:
            kw[key] = batch[key] if dtype == torch.float64 else batch[key].float()
    if "num_items" in uses:
        kw["num_items"] = 3 * batch["logits"].shape[0]
    return kw


def loss_runner(fn, batch, dtype, config, uses=ALL_INPUTS, *, inplace: bool = False, loss_scale: float = 1.0,
                num_items=None, **extra):
    """check_vs_oracle's `run` for a loss on logits: `fn(logits, targets, advantages, config=…,
    return_entropy=True, **optional inputs, **extra)`, backward of loss_scale·loss (≠ 1 checks
    that the upstream gradient scales every gradient). `inplace`: the backend gets a non-leaf
    copy of the logits leaf and inplace_backward=True. The logits keep their strides."""
    x = batch["logits"].to(dtype)
    adv = batch["advantages"] if dtype == torch.float64 else batch["advantages"].float()
    kw = loss_kwargs(batch, uses, dtype)
    if num_items is not None:
        kw["num_items"] = num_items

    def run(mode):
        leaf = (x.double() if mode == TRUTH else x).clone().requires_grad_(True)
        if mode == BACKEND:
            src = leaf * 1 if inplace else leaf  # in place needs a non-leaf buffer to overwrite
            extra_kw = dict(extra, inplace_backward=True) if inplace else extra
            out = fn(src, batch["targets"], adv, config=config, return_entropy=True, **kw, **extra_kw)
        else:  # the reference's gradient is rounded to the logits dtype on its way back through .to()
            out = grpo_loss_reference(leaf.to(compute_dtype(leaf.dtype)), batch["targets"], adv, config=config,
                                      return_entropy=True, **kw)
        (out.loss * loss_scale).backward()
        return loss_results(out, {"d_logits": leaf.grad})

    return run


def check_loss(fn, batch, dtype, config, uses=ALL_INPUTS, **kw) -> dict:
    """check_vs_oracle(loss_runner(…), dtype): loss, logp, entropy, every metric, d_logits."""
    return check_vs_oracle(loss_runner(fn, batch, dtype, config, uses, **kw), dtype)


def fused_linear_runner(fn, batch, dtype, config, with_bias: bool, uses=ALL_INPUTS, *, loss_scale: float = 3.0,
                        **extra):
    """check_vs_oracle's `run` for a fused lm_head + loss: `fn(hidden, weight, targets, advantages,
    bias=…, config=…, return_entropy=True, **optional inputs, **extra)`. The oracle materialises
    the logits: the reference makes them in the input dtype, as the backend's chunk matmul does."""
    adv = batch["advantages"] if dtype == torch.float64 else batch["advantages"].float()
    kw = loss_kwargs(batch, uses, dtype)

    def run(mode):
        leaves = [(batch[k].to(dtype).double() if mode == TRUTH else batch[k].to(dtype)).clone().requires_grad_(True)
                  for k in ("hidden", "weight", "bias")]
        hid, w, bias = leaves
        if mode == BACKEND:
            out = fn(hid, w, batch["targets"], adv, bias=bias if with_bias else None, config=config,
                     return_entropy=True, **kw, **extra)
        else:
            logits = hid @ w.t() + (bias if with_bias else 0)
            out = grpo_loss_reference(logits.to(compute_dtype(logits.dtype)), batch["targets"], adv, config=config,
                                      return_entropy=True, **kw)
        (out.loss * loss_scale).backward()
        return loss_results(out, dict(zip(("d_hidden", "d_weight", "d_bias"), (x.grad for x in leaves))))

    return run


def logprobs_runner(fn, logits, targets, temperature: float = 1.0, grad_weights=None, softcap=None):
    """check_vs_oracle's `run` for `fn(logits, targets, temperature, True) -> (logp, entropy)`
    (`fn(…, softcap=softcap)` when a soft cap is given); with `grad_weights` (w_logp, w_entropy)
    [N] also d_logits of Σ w_logp·logp + Σ w_entropy·entropy."""
    cap_kw = {} if softcap is None else {"softcap": softcap}

    def run(mode):
        leaf = (logits.double() if mode == TRUTH else logits).clone().requires_grad_(grad_weights is not None)
        if mode == BACKEND:
            logp, ent = fn(leaf, targets, temperature, True, **cap_kw)
        else:
            logp, ent = token_logprobs_reference(leaf.to(compute_dtype(leaf.dtype)), targets, temperature, True,
                                                 softcap)
        res = dict(logp=logp, entropy=ent)
        if grad_weights is not None:
            w1, w2 = (w.to(logp.dtype) for w in grad_weights)
            ((logp * w1).sum() + (ent * w2).sum()).backward()
            res["d_logits"] = leaf.grad
        return {k: v.detach() if v is not None else None for k, v in res.items()}

    return run


def check_fused_linear(fn, batch, dtype, config, with_bias: bool, uses=ALL_INPUTS, **kw) -> dict:
    """check_vs_oracle(fused_linear_runner(…), dtype): loss, logp, entropy, every metric and the
    gradients of hidden, weight and bias (None without a bias). The logits are made in `dtype`,
    so every result is held to TOL[dtype]."""
    return check_vs_oracle(fused_linear_runner(fn, batch, dtype, config, with_bias, uses, **kw), dtype,
                           value_dtype=dtype)
