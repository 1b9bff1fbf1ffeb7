"""Fused lm_head + GRPO loss: from hidden states [N, H] and the lm_head weight [V, H] (+ bias)
straight to the loss and the gradients of hidden, weight and bias, without any [N, V] tensor.

Follows the chunked scheme of Liger-Kernel's `LigerFusedLinearCrossEntropy` (gradients computed
during the forward, the backward only scales them by the upstream gradient): tokens are split
into chunks of C rows; each chunk's logits [C, V] are made by one matmul, consumed by the
log-prob kernel, overwritten in place by the logits gradient, and turned into
dH_c = dZ_c·W and dW += dZ_cᵀ·H_c (fp32 accumulator), db += Σ dZ_c — then freed.

The O(N) objective (`objective.py`) couples tokens only through per-sequence terms:
- token-level ratio: every g_t, h_t depends on its own token alone (the aggregation weights a_t
  come from the mask up front), so each chunk is finished in one visit: 3 matmuls in all,
  as many as a plain lm_head forward + backward;
- sequence-level ratio (GSPO): the ratio needs every token of a sequence first, so a first
  sweep makes logp / entropy per chunk and a second sweep recomputes each chunk's logits for the
  gradient: 4 matmuls (the price of never holding N×V).
Per chunk the kernels are the Triton ones (`logprobs.py`, `grpo_loss.py`) on CUDA or under
TRITON_INTERPRET, or the torch streaming twins of `cpu_stream.py` on CPU (`impl="torch"`): one
algorithm for both, the kernels per chunk are the backend. (This is the only fused-linear
algorithm: the gradient-in-forward scheme needs 3 matmuls where recomputing the chunk in the
backward needs 4, and sequence-level ratios take the two-sweep branch below.)
Backend "cce" (`triton/fused_linear.py`) is the single-kernel alternative (Apple's Cut
Cross-Entropy): the matmul tile and the online log-sum-exp in one kernel, so no logits tile
reaches memory; all N tokens go in one launch (nothing N×V is held), the objective in between.
A soft cap (`LossConfig.softcap`, Gemma 2/3) is applied by the per-chunk kernels (or inside the
cce kernels) to each logits tile; the chunk's gradient they write is w.r.t. the uncapped logits,
which is what the dH / dW matmuls need.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from fastgrpo import env

from fastgrpo.kernels.contract import LossConfig, LossOutput
from fastgrpo.kernels.objective import ObjectiveInputs, objective_coefficients, objective_metrics, prepare_objective
from fastgrpo.kernels import cpu_stream

# Chunk logits budget: 1 GiB on a GPU (a 4k×152k bf16 chunk is 1.2 GB; large chunks keep the
# three GEMMs efficient and limit the read-modify-write passes over the fp32 dW accumulator,
# 2.5 GB for 152k×4096), 32 MiB on CPU where the streaming torch path tiles again anyway.
_CHUNK_BYTES_CUDA = 1 << 30
_CHUNK_BYTES_CPU = 1 << 25
FUSED_BACKENDS = ("triton", "torch", "cce")


def default_chunk_size(n: int, v: int, dtype: torch.dtype, device: torch.device) -> int:
    budget = _CHUNK_BYTES_CUDA if device.type == "cuda" else _CHUNK_BYTES_CPU
    rows = budget // max(1, v * torch.finfo(dtype).bits // 8)
    rows = max(128, rows // 128 * 128)  # multiples of 128 keep the GEMM tiles full
    return int(max(1, min(n, rows)))


def _triton_fwd(logits, targets, temperature, need_ent, softcap):
    from fastgrpo.kernels.triton.logprobs import token_logprobs_fwd

    return token_logprobs_fwd(logits, targets, temperature, need_ent, softcap)


def _triton_bwd(logits, targets, lse, g, h, ent, temperature, softcap):
    from fastgrpo.kernels.triton.grpo_loss import grpo_loss_bwd

    return grpo_loss_bwd(logits, targets, lse, g, h, ent, temperature, out=logits, softcap=softcap)


def _torch_fwd(logits, targets, temperature, need_ent, softcap):
    return cpu_stream.logprob_stats(logits, targets, temperature, need_ent, softcap=softcap)


def _torch_bwd(logits, targets, lse, g, h, ent, temperature, softcap):
    return cpu_stream.logits_grad(logits, targets, lse, g, h, ent, temperature, out=logits, softcap=softcap)


@functools.lru_cache(maxsize=None)
def _addmm_out_dtype_ok(device_type: str) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=fp32, out=acc)` (bf16 GEMM straight into an
    fp32 accumulator, torch ≥ 2.8 on CUDA) works here; probed once on a tiny problem."""
    if device_type != "cuda":
        return False
    try:
        a = torch.ones(4, 8, dtype=torch.bfloat16, device="cuda")
        acc = torch.ones(4, 4, dtype=torch.float32, device="cuda")
        torch.addmm(acc, a, a.t(), out_dtype=torch.float32, out=acc)
        return bool((acc == 9).all())
    except (RuntimeError, TypeError):
        return False


def _acc_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with acc fp32 and a, b maybe half precision."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _addmm_out_dtype_ok(acc.device.type):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        # Upcast rather than round each chunk's product to bf16 before the sum: TRL measured that
        # rounding per chunk biases training (entropy drifts); this branch is the CPU / old-torch one.
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _slice(inp: ObjectiveInputs, s: int, e: int) -> ObjectiveInputs:
    cut = (lambda x: None if x is None else x[s:e])
    return dataclasses.replace(inp, on=inp.on[s:e], mask=inp.mask[s:e], advantages=cut(inp.advantages),
                               old_logp=cut(inp.old_logp), ref_logp=cut(inp.ref_logp),
                               weights=cut(inp.weights), seq_ids=inp.seq_ids[s:e], agg=inp.agg[s:e])


def fused_linear_fwd(hidden, weight, bias, targets, inp: ObjectiveInputs, config: LossConfig, chunk: int,
                     backend: str, need_entropy: bool, need_dh: bool, need_dw: bool, need_db: bool):
    """Launcher (no autograd): returns loss, logp, entropy, ratio, kl and the gradients
    dH [N, H] (hidden dtype), dW [V, H] fp32, db [V] fp32 (None where not needed)."""
    if backend == "cce":
        return _fused_linear_cce(hidden, weight, bias, targets, inp, config, need_entropy, need_dh, need_dw, need_db)
    fwd, bwd = (_triton_fwd, _triton_bwd) if backend == "triton" else (_torch_fwd, _torch_bwd)
    n, _ = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    tau, cap = config.temperature, config.softcap
    need_ent = need_entropy or config.entropy_coef != 0.0
    logp = torch.empty(n, dtype=cdt, device=dev)
    ent = torch.empty(n, dtype=cdt, device=dev) if need_ent else None
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev) if need_dh else None
    dw = torch.zeros(v, weight.shape[1], dtype=cdt, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=cdt, device=dev) if need_db else None

    def chunk_logits(s, e):
        h_c = hidden[s:e]
        return torch.mm(h_c, weight.t()) if bias is None else torch.addmm(bias, h_c, weight.t())

    def grad_matmuls(dz, s, e):
        if need_dh:
            torch.mm(dz, weight, out=dh[s:e])
        if need_dw:
            _acc_mm(dw, dz.t(), hidden[s:e])
        if need_db:
            db.add_(dz.sum(0, dtype=cdt))

    if config.ratio_level == "token":
        loss = torch.zeros((), dtype=cdt, device=dev)
        ratio = torch.empty(n, dtype=cdt, device=dev)
        kl = torch.empty(n, dtype=cdt, device=dev) if config.beta != 0.0 else None
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = chunk_logits(s, e)
            lp, lse, en = fwd(z, targets[s:e], tau, need_ent, cap)
            loss_c, g, h, r_c, kl_c = objective_coefficients(lp, en, _slice(inp, s, e), config)
            loss += loss_c
            logp[s:e], ratio[s:e] = lp, r_c
            if need_ent:
                ent[s:e] = en
            if kl is not None:
                kl[s:e] = kl_c
            if need_dh or need_dw or need_db:  # nothing to differentiate (e.g. no_grad scoring): skip
                grad_matmuls(bwd(z, targets[s:e], lse, g, h, en, tau, cap), s, e)
            del z
    else:
        lses = torch.empty(n, dtype=cdt, device=dev)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lp, lses[s:e], en = fwd(chunk_logits(s, e), targets[s:e], tau, need_ent, cap)
            logp[s:e] = lp
            if need_ent:
                ent[s:e] = en
        loss, g, h, ratio, kl = objective_coefficients(logp, ent, inp, config)
        for s in range(0, n if (need_dh or need_dw or need_db) else 0, chunk):
            e = min(n, s + chunk)
            z = chunk_logits(s, e)
            dz = bwd(z, targets[s:e], lses[s:e], g[s:e], None if h is None else h[s:e],
                     None if ent is None else ent[s:e], tau, cap)
            grad_matmuls(dz, s, e)
            del z, dz
    return loss, logp, ent, ratio, kl, dh, dw, db


def _fused_linear_cce(hidden, weight, bias, targets, inp: ObjectiveInputs, config: LossConfig, need_entropy: bool,
                      need_dh: bool, need_dw: bool, need_db: bool):
    """Backend "cce": log-probs of all N tokens from one kernel, the objective on [N] vectors,
    then one gradient kernel accumulating dH (fp32, cast at the end), dW and db."""
    from fastgrpo.kernels.triton.fused_linear import cce_bwd, cce_fwd

    tau = config.temperature
    need_ent = need_entropy or config.entropy_coef != 0.0
    logp, lse, ent = cce_fwd(hidden, weight, bias, targets, tau, need_ent, config.softcap)
    loss, g, h, ratio, kl = objective_coefficients(logp, ent, inp, config)
    dev, v = hidden.device, weight.shape[0]
    dh32 = torch.zeros(hidden.shape, dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.zeros(v, weight.shape[1], dtype=torch.float32, device=dev) if need_dw else None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if need_db else None
    cce_bwd(hidden, weight, bias, targets, lse, g, h, ent if h is not None else None, tau, dh32, dw, db,
            softcap=config.softcap)
    dh = dh32.to(hidden.dtype) if need_dh else None
    return loss, logp, ent, ratio, kl, dh, dw, db


class FusedLinearGRPOFunction(torch.autograd.Function):
    """Gradients are made in the forward; the backward scales them by the upstream gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inp, config, chunk, backend, need_entropy, side):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        loss, logp, ent, ratio, kl, dh, dw, db = fused_linear_fwd(
            hidden, weight, bias, targets, inp, config, chunk, backend, need_entropy, need_dh, need_dw, need_db)
        side.update(logp=logp, entropy=ent, metrics=objective_metrics(ratio, kl, ent, inp, config))
        ctx.save_for_backward(dh, dw, db)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dh, dw, db = ctx.saved_tensors
        w_dt, b_dt = ctx.dtypes
        gh = None if dh is None else dh * grad_loss.to(dh.dtype)
        gw = None if dw is None else (dw * grad_loss.to(dw.dtype)).to(w_dt)
        gb = None if db is None else (db * grad_loss.to(db.dtype)).to(b_dt)
        return gh, gw, gb, None, None, None, None, None, None, None


def fused_linear_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, *,
                      backend: str, bias: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None, mask=None,
                      old_logp=None, ref_logp=None, weights=None, cu_seqlens=None,
                      config: Optional[LossConfig] = None, num_items=None,
                      return_entropy: bool = False) -> LossOutput:
    """GRPO loss of `logits = hidden @ weight.T (+ bias)` without materialising the logits, on
    checked inputs (`fastgrpo.loss.fused_linear_grpo_loss` is the validating facade; `cu_seqlens`
    arrives checked). `backend`: "triton" (per-chunk Triton kernels: CUDA, or TRITON_INTERPRET=1)
    or "torch" (the CPU streaming statistics of cpu_stream.py per chunk). `loss` is
    differentiable w.r.t. hidden, weight and bias; `chunk_size`: tokens per chunk (default:
    chunk logits ≈ 1 GiB on a GPU, 32 MiB on CPU)."""
    config = config or LossConfig()
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {FUSED_BACKENDS}")
    if backend in ("triton", "cce") and not (hidden.is_cuda or env.triton_interpret()):
        raise ValueError("impl: 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 on CPU); use 'torch' or 'auto'")
    n = hidden.shape[0]
    dev = hidden.device
    cdt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    inp = prepare_objective(n, dev, cdt, advantages, mask, old_logp, ref_logp, weights, cu_seqlens, config, num_items)
    chunk = chunk_size or default_chunk_size(n, weight.shape[0], hidden.dtype, dev)
    side = {}
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, weight, bias)):
        loss = FusedLinearGRPOFunction.apply(hidden, weight, bias, targets, inp, config, chunk, backend,
                                             bool(return_entropy), side)
    else:  # scoring only: no gradient kernel, no gradient matmuls
        loss, logp, ent, ratio, kl, _, _, _ = fused_linear_fwd(
            hidden, weight, bias, targets, inp, config, chunk, backend, bool(return_entropy), False, False, False)
        side.update(logp=logp, entropy=ent, metrics=objective_metrics(ratio, kl, ent, inp, config))
    ent = side["entropy"] if (return_entropy or config.entropy_coef != 0.0) else None
    return LossOutput(loss=loss, logp=side["logp"], entropy=ent, metrics=side["metrics"])
