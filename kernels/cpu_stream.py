"""The fast CPU path of the GRPO loss: vocabulary-streaming log-probs / entropy in plain torch.

Algorithm: the online (streaming) log-sum-exp of Milakov & Gimelshein 2018 ("Online normalizer
calculation for softmax"), as used by FlashAttention, Liger-Kernel and Apple's Cut Cross-Entropy:
the logits are visited in tiles of R rows × C vocabulary columns, each tile is upcast once into a
reused float32 buffer, and per row only a running max m, a running Σ e^{z−m} and (for the
entropy) a running Σ e^{z−m}(z−m) are kept. The backward recomputes the softmax tile by tile
from the saved log-sum-exp and writes ∂loss/∂z = (g·(onehot − p) − h·p·(log p + H))/τ straight
into the gradient buffer, or into the logits buffer itself when `inplace_backward=True`.

Extra memory: O(N) statistics plus two R×C buffers (R·C ≤ `_TILE_ELEMS`); never an N×V float32
copy of the logits. In this two-pass mode the autograd boundary is the log-prob op
(`common.TokenLogprobsFunction` over `torch_backend()`): the O(N) objective on top of it (`objective.py`) is ordinary
differentiable torch, which serves sequence-level (GSPO) ratios and `token_logprobs`.

Single-pass mode (`SinglePassGRPOLossFunction`, the default for token-level ratios when a gradient
is wanted), as Liger-Kernel's losses do it: blocks of full-vocabulary rows are exponentiated once,
the block's objective coefficients are computed right away, and the gradient is written during the
forward; the backward only scales it. On CPU the exp costs ~10× a copy per element, so one exp
instead of two is most of the speed. Its buffers are R×V rows (R·V ≤ `_FUSED_ELEMS`).

Soft-capping (`LossConfig.softcap`, Gemma 2/3's final_logit_softcapping): each tile is capped on its
way into the float32 buffer, c = cap·tanh(z/cap) in transformers' op order (so float32 capped
logits equal the model's own bit for bit), and the backward multiplies by 1 − tanh²(z/cap) from a
tanh recomputed per tile: the gradient is w.r.t. the uncapped logits, and no capped N×V copy
exists. It costs one more R×C (R×V in single-pass mode) buffer and a tanh per element per pass.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from fastgrpo.kernels.contract import LossConfig, LogprobsBackend, LossOutput, differentiable_logprobs
from fastgrpo.kernels.objective import (ObjectiveInputs, objective_coefficients, objective_loss, objective_metrics,
                        prepare_objective, slice_objective)

# Tile budget in elements: 2^18 fp32 = 1 MiB per buffer, so the 4–6 elementwise passes over a
# tile hit L2; measured on the 2-core dev box (N=1024, V=32000, 1 thread): 2^18 gave the fastest
# fwd+bwd, 2^16 pays the ~10 µs per-op overhead of eager torch, 2^20–2^22 spill to memory.
_TILE_ELEMS = 1 << 18


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 logits keep float64 (the oracle tests); everything else is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def tile_shape(n: int, v: int, vocab_chunk: Optional[int] = None) -> Tuple[int, int]:
    """(rows R, columns C) of one tile: C = min(V, vocab_chunk), R·C ≤ _TILE_ELEMS, R ≥ 1."""
    from fastgrpo import env

    chunk = vocab_chunk if vocab_chunk is not None else env.vocab_chunk()
    if chunk < 1:
        raise ValueError(f"vocab_chunk: expected a positive number of vocabulary columns, got {chunk}")
    c = max(1, min(v, chunk))
    r = max(1, min(max(n, 1), _TILE_ELEMS // c))
    return r, c


def _shifted_tile(src: torch.Tensor, shift: torch.Tensor, buf: torch.Tensor, inv_tau: float,
                  softcap: Optional[float] = None, tbuf: Optional[torch.Tensor] = None) -> torch.Tensor:
    """buf ← (src − shift)·(1/τ) in the compute dtype: the subtraction reads the bf16/fp32 tile and
    writes the upcast result in one pass (tensor-tensor type promotion), so no separate copy.
    With `softcap`: buf ← (cap·t − shift)·(1/τ), t = tanh(src/cap) left in `tbuf` (default: `buf`
    itself, then t is not kept) for a backward's 1 − t²; `shift` is then a capped value."""
    r, c = src.shape
    if softcap is None:
        out = torch.sub(src, shift.unsqueeze(1), out=buf[:r, :c])
    else:
        t = (buf if tbuf is None else tbuf)[:r, :c]
        t.copy_(src).div_(softcap).tanh_()  # upcast first: a bf16 division would round z/cap to bf16
        out = torch.mul(t, softcap, out=buf[:r, :c]).sub_(shift.unsqueeze(1))
    if inv_tau != 1.0:
        out.mul_(inv_tau)
    return out


def _cap_(x: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """x ← cap·tanh(x/cap) in place on an [N]-sized vector (row maxima, target logits)."""
    return x if softcap is None else x.div_(softcap).tanh_().mul_(softcap)


_SHIFT_FLOOR = -1e30  # finite in float32 and float64


@torch.no_grad()
def logprob_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                  need_entropy: bool = False, vocab_chunk: Optional[int] = None, softcap: Optional[float] = None):
    """One streaming pass: (logp [N], lse [N], entropy [N] or None) of softmax(c/τ), in the
    compute dtype, c = softcap·tanh(z/softcap) (c = z without a cap). lse is the log-sum-exp of
    c/τ, saved for the backward."""
    n, v = logits.shape
    cdt = compute_dtype(logits.dtype)
    dev = logits.device
    inv_tau = 1.0 / float(temperature)
    lse = torch.empty(n, dtype=cdt, device=dev)
    ent = torch.empty(n, dtype=cdt, device=dev) if need_entropy else None
    if n == 0:
        return torch.empty(0, dtype=cdt, device=dev), lse, ent
    rows, cols = tile_shape(n, v, vocab_chunk)
    ybuf = torch.empty(rows, cols, dtype=cdt, device=dev)
    ebuf = torch.empty(rows, cols, dtype=cdt, device=dev) if need_entropy else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        m = s = u = None  # running max of raw z, Σ e^{(z−m)/τ}, Σ e^{(z−m)/τ}·(z−m)/τ
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            src = logits[r0:r1, c0:c1]
            # max of raw logits is exact in any dtype (τ > 0 keeps order); floored at −1e30 so a
            # tile that is all −inf shifts by a finite value instead of making (−inf) − (−inf) = NaN
            # (the cap is monotone: the capped maximum is the cap of the raw one)
            cm = _cap_(src.amax(dim=1).to(cdt).clamp_(min=_SHIFT_FLOOR), softcap)
            m_new = cm if m is None else torch.maximum(m, cm)
            y = _shifted_tile(src, m_new, ybuf, inv_tau, softcap)  # (c − m_new)/τ ≤ 0
            if need_entropy:
                e = torch.exp(y, out=ebuf[: r1 - r0, : c1 - c0])
                s_c = e.sum(dim=1)
                u_c = y.mul_(e).sum(dim=1)
            else:
                s_c = y.exp_().sum(dim=1)
            if m is None:
                s, u = s_c, (u_c if need_entropy else None)
            else:
                # rescale the running sums from the old max to the new one (d ≤ 0, finite)
                d = (m - m_new) * inv_tau
                scale = torch.exp(d)
                if need_entropy:
                    u = scale * (u + d * s) + u_c
                s = scale * s + s_c
            m = m_new
        log_s = torch.log(s)
        lse[r0:r1] = m * inv_tau + log_s
        if need_entropy:
            ent[r0:r1] = log_s - u / s  # H = log Σe^y − Σ e^y·y / Σ e^y with y = (z − m)/τ
    zt = _cap_(logits.gather(1, targets.long().unsqueeze(1)).squeeze(1).to(cdt), softcap) * inv_tau
    return zt - lse, lse, ent


@torch.no_grad()
def logits_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                h: Optional[torch.Tensor], entropy: Optional[torch.Tensor], temperature: float,
                out: torch.Tensor, vocab_chunk: Optional[int] = None, softcap: Optional[float] = None) -> torch.Tensor:
    """Write ∂loss/∂z = (g·(onehot(y) − p) − h·p·(log p + H))/τ into `out` ([N, V], any float
    dtype; may be `logits` itself: every tile is read before it is overwritten). With `softcap`
    p is the softmax of the capped logits and the result is times 1 − tanh²(z/cap): the gradient
    w.r.t. the uncapped z."""
    n, v = logits.shape
    if n == 0:
        return out
    cdt = lse.dtype
    tau = float(temperature)
    inv_tau = 1.0 / tau
    gs = g.to(cdt).unsqueeze(1)
    neg_g = gs * -inv_tau  # the final multiply by −g/τ also downcasts into `out`
    hs = None if h is None else h.to(cdt).unsqueeze(1)
    lse_raw = lse * tau  # log p = (z − τ·lse)/τ
    rows, cols = tile_shape(n, v, vocab_chunk)
    ybuf = torch.empty(rows, cols, dtype=cdt, device=logits.device)
    pbuf = torch.empty(rows, cols, dtype=cdt, device=logits.device) if hs is not None else None
    tbuf = torch.empty(rows, cols, dtype=cdt, device=logits.device) if softcap is not None else None
    tgt = targets.long()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t_r = tgt[r0:r1]
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            y = _shifted_tile(logits[r0:r1, c0:c1], lse_raw[r0:r1], ybuf, inv_tau, softcap, tbuf)  # log p
            # ∂c/∂z = 1 − t² (t = tanh(z/cap), as torch's tanh backward forms it)
            dcap = None if tbuf is None else tbuf[: r1 - r0, : c1 - c0].square_().neg_().add_(1.0)
            hit = (t_r >= c0) & (t_r < c1)
            rr = hit.nonzero().squeeze(1) if bool(hit.any()) else None
            if hs is None:
                q = y.exp_()  # ∂/∂z = −g·(p − onehot)/τ
                if rr is not None:
                    q.index_put_((rr, t_r[rr] - c0), q.new_tensor(-1.0), accumulate=True)
                if dcap is not None:
                    q.mul_(dcap)
                torch.mul(q, neg_g[r0:r1], out=out[r0:r1, c0:c1])
            else:
                # ∂/∂z = −(p·(g + h·(log p + H)) − g·onehot)/τ
                p = torch.exp(y, out=pbuf[: r1 - r0, : c1 - c0])
                q = y.add_(entropy[r0:r1].to(cdt).unsqueeze(1)).mul_(hs[r0:r1]).add_(gs[r0:r1]).mul_(p)
                if rr is not None:
                    q.index_put_((rr, t_r[rr] - c0), -gs[r0:r1][rr].squeeze(1), accumulate=True)
                if dcap is not None:
                    q.mul_(dcap)
                torch.mul(q, -inv_tau, out=out[r0:r1, c0:c1])
    return out


def torch_backend(vocab_chunk: Optional[int] = None) -> LogprobsBackend:
    """The CPU streaming passes as a `LogprobsBackend` (common.TokenLogprobsFunction)."""

    def stats(logits, targets, temperature, need_entropy, softcap=None):
        return logprob_stats(logits, targets, temperature, need_entropy, vocab_chunk, softcap)

    def grad(logits, targets, lse, g, h, entropy, temperature, out, softcap=None):
        out = torch.empty_like(logits) if out is None else out
        return logits_grad(logits, targets, lse, g, h, entropy, temperature, out, vocab_chunk, softcap)

    return LogprobsBackend(stats, grad)


def token_logprobs_torch(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         return_entropy: bool = False, inplace_backward: bool = False,
                         vocab_chunk: Optional[int] = None, softcap: Optional[float] = None):
    """Differentiable (logp, entropy | None), both [N] in float32 (float64 for float64 logits), of
    softmax(c/τ) with c = softcap·tanh(z/softcap) (c = z for softcap None)."""
    return differentiable_logprobs(torch_backend(vocab_chunk), logits, targets, temperature, return_entropy,
                                   inplace_backward, softcap)


def loss_from_logprobs(logp, entropy, n, device, advantages, *, mask, old_logp, ref_logp, weights,
                       cu_seqlens, config: LossConfig, num_items, return_entropy) -> LossOutput:
    """The objective on top of differentiable logp / entropy; shared with the fused-linear path."""
    inp = prepare_objective(n, device, logp.dtype, advantages, mask, old_logp, ref_logp, weights,
                            cu_seqlens, config, num_items)
    loss, ratio, kl = objective_loss(logp, entropy, inp, config)
    metrics = objective_metrics(ratio, kl, entropy, inp, config)
    return LossOutput(loss=loss, logp=logp.detach(),
                      entropy=entropy.detach() if (entropy is not None and return_entropy) else None,
                      metrics=metrics)


# Single-pass mode: rows of the full vocabulary kept between the exp and the gradient, 2^22
# elements = 16 MiB fp32 per buffer (27 rows at V = 152k).
_FUSED_ELEMS = 1 << 22


@torch.no_grad()
def loss_and_grad_single_pass(logits: torch.Tensor, targets: torch.Tensor, inp: ObjectiveInputs,
                              config: LossConfig, out: torch.Tensor, need_entropy: bool):
    """Token-level ratios only: loss, logp, entropy, ratio, kl and ∂loss/∂z written into `out`,
    with ONE exp per logit. Per block of full-vocabulary rows: e = exp((z − m)/τ), s = Σe, the
    block's log-probs and entropies, its objective coefficients g, h (exact per block because a
    token-level objective is separable and the aggregation weights are global), then
    ∂loss/∂z = −(g·(e/s − onehot) + h·(e/s)·(log p + H))/τ from the same e. The two-pass
    forward/backward (`common.TokenLogprobsFunction`) computes the exp twice; on CPU the exp is the
    bottleneck (≈ 10× a copy per element)."""
    n, v = logits.shape
    cdt = compute_dtype(logits.dtype)
    dev = logits.device
    inv_tau = 1.0 / float(config.temperature)
    cap = config.softcap
    logp = torch.empty(n, dtype=cdt, device=dev)
    ent = torch.empty(n, dtype=cdt, device=dev) if need_entropy else None
    ratio = torch.empty(n, dtype=cdt, device=dev)
    kl = torch.empty(n, dtype=cdt, device=dev) if config.beta != 0.0 else None
    loss = torch.zeros((), dtype=cdt, device=dev)
    if n == 0:
        return loss, logp, ent, ratio, kl
    rows = max(1, min(n, _FUSED_ELEMS // v))
    ybuf = torch.empty(rows, v, dtype=cdt, device=dev)
    ebuf = torch.empty(rows, v, dtype=cdt, device=dev) if need_entropy else None
    tbuf = torch.empty(rows, v, dtype=cdt, device=dev) if cap is not None else None  # tanh(z/cap), then 1 − t²
    tgt = targets.long()
    zt = _cap_(logits.gather(1, tgt.unsqueeze(1)).squeeze(1).to(cdt), cap) * inv_tau
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        src = logits[r0:r1]
        m = _cap_(src.amax(dim=1).to(cdt).clamp_(min=_SHIFT_FLOOR), cap)
        y = _shifted_tile(src, m, ybuf, inv_tau, cap, tbuf)  # (c − m)/τ
        dcap = None if tbuf is None else tbuf[: r1 - r0].square_().neg_().add_(1.0)  # ∂c/∂z = 1 − t²
        e = torch.exp(y, out=ebuf[: r1 - r0]) if need_entropy else y.exp_()
        s = e.sum(dim=1)
        log_s = torch.log(s)
        lp = zt[r0:r1] - (m * inv_tau + log_s)
        logp[r0:r1] = lp
        h_ent = None
        if need_entropy:
            u = torch.bmm(e.unsqueeze(1), y.unsqueeze(2)).reshape(-1)  # Σ e·y as a batched dot: no temporary
            h_ent = log_s - u / s
            ent[r0:r1] = h_ent
        loss_b, g, h, r_b, kl_b = objective_coefficients(lp, h_ent, slice_objective(inp, r0, r1), config)
        loss += loss_b
        ratio[r0:r1] = r_b
        if kl is not None:
            kl[r0:r1] = kl_b
        rr = torch.arange(r1 - r0, device=dev)
        inv_s = s.reciprocal().unsqueeze(1)
        if h is None:
            q = e.mul_(inv_s)  # p
            q[rr, tgt[r0:r1]] -= 1.0
            if dcap is not None:
                q.mul_(dcap)
            torch.mul(q, (g * -inv_tau).unsqueeze(1), out=out[r0:r1])
        else:
            # p·(g + h·(log p + H)) − g·onehot, with log p + H = y − log s + H
            q = y.sub_((log_s - h_ent).unsqueeze(1)).mul_(h.unsqueeze(1)).add_(g.unsqueeze(1))
            q.mul_(e).mul_(inv_s)
            q[rr, tgt[r0:r1]] -= g
            if dcap is not None:
                q.mul_(dcap)
            torch.mul(q, -inv_tau, out=out[r0:r1])
    return loss, logp, ent, ratio, kl


class SinglePassGRPOLossFunction(torch.autograd.Function):
    """logits → (loss, logp, entropy, ratio, kl) computing ∂loss/∂logits during the forward; the
    backward only scales it by the upstream gradient (Liger-Kernel's scheme for its losses)."""

    @staticmethod
    def forward(ctx, logits, targets, inp, config, need_entropy, inplace):
        out = logits if inplace else torch.empty_like(logits)
        loss, logp, ent, ratio, kl = loss_and_grad_single_pass(logits, targets, inp, config, out, need_entropy)
        ctx.grad = out
        side = [logp, ent if ent is not None else logp.new_empty(0), ratio, kl if kl is not None else logp.new_empty(0)]
        ctx.mark_non_differentiable(*side)
        return (loss, *side)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, *unused):
        grad = ctx.grad
        if grad is None:
            raise RuntimeError("grpo_loss (torch single-pass path): backward called twice; the gradient buffer "
                               "was handed over on the first call")
        ctx.grad = None
        if g_loss is not None and float(g_loss) != 1.0:
            grad.mul_(g_loss.to(grad.dtype))  # e.g. a 1/grad-accumulation scale on the loss
        return grad, None, None, None, None, None


def grpo_loss_torch(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, *,
                    mask=None, old_logp=None, ref_logp=None, weights=None, cu_seqlens=None,
                    config: Optional[LossConfig] = None, num_items=None, inplace_backward: bool = False,
                    return_entropy: bool = False, vocab_chunk: Optional[int] = None,
                    single_pass: Optional[bool] = None) -> LossOutput:
    """The whole loss contract on packed logits [N, V] (inputs already validated by the facade;
    `cu_seqlens` a CPU int64 [S+1] tensor or None for one sequence).

    `single_pass` (default: whenever a gradient is wanted and the ratio is token-level) computes
    the gradient in the forward with one exp per logit; with `inplace_backward=True` it is then
    written into the logits during the forward, so the logits must not be read after this call.
    Otherwise the forward streams the statistics and the backward recomputes the softmax."""
    config = config or LossConfig()
    need_ent = return_entropy or config.entropy_coef != 0.0
    wants_grad = logits.requires_grad and torch.is_grad_enabled()
    if single_pass is None:
        single_pass = wants_grad and config.ratio_level == "token"
    if single_pass and wants_grad:
        if config.ratio_level != "token":
            raise ValueError("single_pass: only for LossConfig.ratio_level='token' (a sequence-level ratio couples "
                             "the tokens of a sequence across row blocks)")
        n = logits.shape[0]
        cdt = compute_dtype(logits.dtype)
        inp = prepare_objective(n, logits.device, cdt, advantages, mask, old_logp, ref_logp, weights, cu_seqlens,
                                config, num_items)
        # a leaf is never overwritten, as in common.differentiable_logprobs
        inplace = bool(inplace_backward) and not logits.is_leaf
        loss, logp, ent, ratio, kl = SinglePassGRPOLossFunction.apply(logits, targets, inp, config, need_ent,
                                                                      inplace)
        ent = ent if need_ent else None
        kl = kl if config.beta != 0.0 else None
        return LossOutput(loss=loss, logp=logp, entropy=ent, metrics=objective_metrics(ratio, kl, ent, inp, config))
    logp, ent = token_logprobs_torch(logits, targets, config.temperature, need_ent, inplace_backward,
                                     vocab_chunk, config.softcap)
    # entropy is returned when asked or when α ≠ 0 (computed anyway), as LossOutput documents
    return loss_from_logprobs(logp, ent, logits.shape[0], logits.device, advantages, mask=mask,
                              old_logp=old_logp, ref_logp=ref_logp, weights=weights, cu_seqlens=cu_seqlens,
                              config=config, num_items=num_items, return_entropy=need_ent)
