"""Float32 oracle checks of the model tests (house style rule 3), built to hold on any x86 CPU:
AVX2 or AVX-512, FMA or not, MKL's or oneDNN's GEMMs (which `auto` picks by vendor), the JIT
builds' `-march=native`.

One product: `check_gemm` holds a float32 GEMM to the float64 product elementwise within
γ_K·(|A|·|B| + |bias|), γ_K = K·u / (1 − K·u), K the summed length (+1 for a bias): the
rounding bound of a sum of K products in any order, blocked or not, with FMA or without
(Higham, "Accuracy and Stability of Numerical Algorithms", §3.1), so it holds for every BLAS on
every CPU. A wrong operand, transpose or bias moves an element by O(|A|·|B|) ≫ γ_K·|A|·|B|.

A whole model (forward and backward): `check_fp32` holds the path under test (oneDNN linears,
fused layers, the packed forward) to the float64 model next to the same-dtype reference (the
plain float32 model): rms|got − truth| ≤ rms|ref − truth| + tol and rms|ref − truth| ≤ tol,
tol = U · depth · max|truth|, the γ_n = n·u bound over the accumulation depth n of the whole
computation (`train_depth`). That is a worst-case bound per sum, while rounding errors add like
√n (Higham & Mary 2019), which leaves √depth ≈ 50× for the amplification by softmax, norms and
cancelling gradient sums. (Single elements are not compared: their errors depend on the CPU's
summation order at ill-conditioned points.) A real bug moves values by O(max|truth|).
Copy of tests/rollout/rollout_oracle.py's check_fp32 (each test folder imports from its own).
"""
from __future__ import annotations

from typing import Optional

import torch

from fp32_oracle import U, check_fp32, fp32_tol  # noqa: F401  (the shared check, re-used by the tests here)


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def check_gemm(name: str, got: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, bias: Optional[torch.Tensor] = None,
               input_err: float = 0.0) -> None:
    """|got − a·b_tᵀ (+ bias)| ≤ γ_K·(|a|·|b_t|ᵀ + |bias|) + input_err elementwise, in float64
    (a [M, K], b_t [N, K]; K + 1 summed terms with a bias)."""
    a64, b64 = a.detach().double(), b_t.detach().double()
    want = a64 @ b64.t()
    mag = a64.abs() @ b64.abs().t()
    k = a.shape[-1]
    if bias is not None:
        want = want + bias.detach().double()
        mag = mag + bias.detach().double().abs()
        k += 1
    bound = gamma(k) * mag + input_err
    err = (got.detach().double() - want).abs()
    bad = ~(err <= bound)
    if bool(bad.any()):
        i = int((err - bound).nan_to_num(float("inf")).reshape(-1).argmax())
        raise AssertionError(f"{name}: {int(bad.sum())}/{err.numel()} elements beyond γ_{k}·|A||B|; "
                             f"worst [flat {i}]: "
                             f"got {float(got.reshape(-1)[i]):.9g}, float64 {float(want.reshape(-1)[i]):.9g}, "
                             f"error {float(err.reshape(-1)[i]):.3g} > {float(bound.reshape(-1)[i]):.3g}")


def forward_depth(config, keys: int) -> int:
    """Accumulation depth of a decoder's logits at `keys` attended positions: per layer two norms
    (2H each: LayerNorm's mean and variance; RMSNorm needs H), the q/k/v and gate/up products (H
    each), the scores and Qwen3's head norm (D each), the softmax sum and P·V (keys each), o_proj
    (heads·D) and down_proj (I); then the final norm (2H) and the lm_head (H)."""
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    return layers * (6 * h + 2 * d + 2 * keys + heads * d + config.intermediate_size) + 3 * h


def train_depth(config, keys: int, rows: int) -> int:
    """Forward and backward: the forward's sums, again transposed in the backward (over output
    features there: gate‖up's 2I, q‖k‖v's (heads + 2·kv heads)·D, the lm_head's vocabulary),
    and each weight gradient's sum over the `rows` tokens."""
    heads, d = config.num_attention_heads, getattr(config, "head_dim", None) or config.hidden_size // heads
    qkv = (heads + 2 * config.num_key_value_heads) * d
    per_layer_out = 2 * config.intermediate_size + qkv
    return 2 * forward_depth(config, keys) + config.num_hidden_layers * per_layer_out + config.vocab_size + rows


FORWARD_OUTPUTS = ("logits", "logp", "hidden")  # the forward's own results: forward depth only


def check_model_run(name: str, config, keys: int, rows: int, got, ref, truth) -> None:
    """`check_fp32` on every tensor of a forward + backward: got / ref / truth are dicts name →
    tensor (outputs and parameter gradients) of the path under test, the float32 reference and
    the float64 model; tol per tensor from its own magnitude and its depth (forward outputs:
    forward_depth, + V for log-probs' log-sum-exp; gradients: train_depth)."""
    assert set(got) == set(truth) == set(ref), f"{name}: tensors {sorted(set(got) ^ set(truth))} differ"
    for k in truth:
        if k in FORWARD_OUTPUTS:
            depth = forward_depth(config, keys) + (config.vocab_size if k == "logp" else 0)
        else:
            depth = train_depth(config, keys, rows)
        check_fp32(f"{name}: {k}", got[k], ref[k], truth[k], fp32_tol(depth, truth[k]))
