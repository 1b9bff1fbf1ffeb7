"""Public GRPO loss API: `grpo_loss`, `token_logprobs`, `fused_linear_grpo_loss` (+ `FusedLinearGRPOLoss`).

A facade with no math of its own (house style): it validates the inputs against the loss contract
of shared/DESIGN.md (`kernels.contract` checks), picks a backend and checks the result is finite.

Backends share one keyword signature so that they are interchangeable:
  "reference" → kernels.reference.grpo_loss_reference   (float64-capable oracle, materialises N×V)
  "torch"     → kernels.cpu_stream.grpo_loss_torch       (vocabulary-streaming CPU path)
  "triton"    → kernels.triton.grpo_loss.grpo_loss_triton (fused GPU kernels)
The fused lm_head path has one chunked algorithm (kernels.fused_linear.fused_linear_loss) whose
per-chunk kernels are the "torch" or "triton" backend.
  "auto"      → "triton" for CUDA tensors when Triton imports, "torch" otherwise.

NaN/Inf logits are detected from the per-token log-probs every backend returns (O(N), no extra
pass over the logits): any non-finite value in a row makes that row's log-sum-exp non-finite.
`FASTGRPO_CHECK_FINITE=0` (fastgrpo.env.check_finite) switches this and the O(N) input checks off.
(With a soft cap, `LossConfig.softcap`, a +Inf logit is capped to +cap as in the model's own head:
only NaN rows are then non-finite.)
"""
from __future__ import annotations

from typing import Optional

import torch

from fastgrpo import env
from fastgrpo.kernels.contract import (
    IMPLS,
    LossConfig,
    LossOutput,
    check_cu_seqlens,
    check_logits_targets,
    check_token_vector,
)

__all__ = ["LossConfig", "LossOutput", "grpo_loss", "token_logprobs", "fused_linear_grpo_loss", "FusedLinearGRPOLoss"]


def _resolve_impl(impl: str, tensor: torch.Tensor, what: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: expected one of {IMPLS}")
    if impl == "auto":
        if tensor.is_cuda and _triton_importable(what):
            return "triton"
        return "torch"
    if impl == "triton" and not tensor.is_cuda and not env.triton_interpret():
        raise ValueError(f"impl='triton': {what} needs CUDA tensors (got device {tensor.device}); "
                         "use impl='torch' on CPU, or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                         "interpreter")
    return impl


_TRITON_MODULES = {"loss": ("fastgrpo.kernels.triton.grpo_loss", "grpo_loss_triton"),
                   "logprobs": ("fastgrpo.kernels.triton.logprobs", "token_logprobs_triton")}


def _triton_importable(what: str) -> bool:
    try:
        _triton_backend(what)
        return True
    except RuntimeError:
        return False


def _triton_backend(what: str):
    import importlib

    mod, name = _TRITON_MODULES[what]
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"impl='triton': the Triton backend {mod}.{name} is not available ({e}); "
                           "use impl='torch'") from e


def _check_config(config) -> LossConfig:
    if config is None:
        return LossConfig()
    if not isinstance(config, LossConfig):
        raise ValueError(f"config: expected a fastgrpo.LossConfig, got {type(config).__name__}")
    return config


def _validate(n, device, advantages, mask, old_logp, ref_logp, weights, cu_seqlens, config, num_items):
    """Checks shared by grpo_loss and fused_linear_grpo_loss; returns the CPU int64 cu_seqlens."""
    check_token_vector(advantages, "advantages", n, device)
    if advantages is None:
        raise ValueError(f"advantages: expected a float tensor [{n}] (one advantage per packed token; "
                         "see fastgrpo.broadcast_to_tokens for per-sequence values)")
    check_token_vector(mask, "mask", n, device, allow_bool=True)
    for name, x in (("old_logp", old_logp), ("ref_logp", ref_logp), ("weights", weights)):
        check_token_vector(x, name, n, device)
    if config.beta > 0 and ref_logp is None:
        raise ValueError("ref_logp: required when LossConfig.beta > 0 (KL to the reference policy), "
                         f"expected a float tensor [{n}]")
    cu = check_cu_seqlens(cu_seqlens, n)
    if num_items is not None:
        if config.loss_agg != "token-mean":
            raise ValueError(f"num_items: only used by loss_agg='token-mean' (got loss_agg={config.loss_agg!r}); "
                             "pass None")
        try:
            ok = float(num_items) > 0
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if not ok:
            raise ValueError(f"num_items: expected a positive token count (int, float or 1-element tensor), "
                             f"got {num_items!r}")
    if env.check_finite() and n > 0:
        on = torch.ones(n, dtype=torch.bool, device=device) if mask is None else mask != 0
        checks = [(name, x) for name, x in (("advantages", advantages), ("old_logp", old_logp),
                                            ("ref_logp", ref_logp if config.beta > 0 else None),
                                            ("weights", weights)) if x is not None]
        bad = torch.stack([(on & ~torch.isfinite(x)).any() for _, x in checks])
        if bool(bad.any()):  # one host sync for all vectors; the culprit is located only on failure
            name, x = checks[int(bad.nonzero()[0])]
            i = int((on & ~torch.isfinite(x)).nonzero()[0])
            raise ValueError(f"{name}: non-finite value {float(x[i])} at masked-in token {i} "
                             "(only positions with mask 0 may hold NaN/Inf)")
    return cu


def _check_output_finite(logp: torch.Tensor, entropy: Optional[torch.Tensor], name: str = "logits"):
    if not env.check_finite() or logp.numel() == 0:
        return
    bad = ~torch.isfinite(logp)
    if entropy is not None:
        bad |= ~torch.isfinite(entropy)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name}: row {i} contains NaN or Inf (its log-prob is {float(logp[i])}); expected finite "
                         "values (set FASTGRPO_CHECK_FINITE=0 to skip this check)")


def grpo_loss(logits: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor, mask=None,
              old_logp=None, ref_logp=None, weights=None, cu_seqlens=None,
              config: Optional[LossConfig] = None, num_items=None, impl: str = "auto",
              inplace_backward: bool = False, return_entropy: bool = False) -> LossOutput:
    """The GRPO loss of packed logits [N, V] (see shared/DESIGN.md, "The loss contract").

    All per-token tensors are [N]; `cu_seqlens [S+1]` delimits the sequences for sequence-level
    ratios and per-sequence aggregations (None: one sequence). `inplace_backward=True` overwrites
    the `logits` buffer with ∂loss/∂logits (in the backward, or already in the forward in the torch
    backend's single-pass mode): do not read the logits after this call.
    """
    config = _check_config(config)
    n, _ = check_logits_targets(logits, targets)
    if targets.device != logits.device:
        raise ValueError(f"targets: is on {targets.device} but logits are on {logits.device}")
    cu = _validate(n, logits.device, advantages, mask, old_logp, ref_logp, weights, cu_seqlens, config, num_items)
    impl = _resolve_impl(impl, logits, "loss")
    kw = dict(mask=mask, old_logp=old_logp, ref_logp=ref_logp, weights=weights, cu_seqlens=cu,
              config=config, num_items=num_items)
    if impl == "reference":
        from fastgrpo.kernels.reference import grpo_loss_reference

        out = grpo_loss_reference(logits, targets, advantages, return_entropy=return_entropy, **kw)
    elif impl == "torch":
        from fastgrpo.kernels.cpu_stream import grpo_loss_torch

        out = grpo_loss_torch(logits, targets, advantages, inplace_backward=inplace_backward,
                              return_entropy=return_entropy, **kw)
    else:
        out = _triton_backend("loss")(logits, targets, advantages, inplace_backward=inplace_backward,
                                      return_entropy=return_entropy, **kw)
    _check_output_finite(out.logp, out.entropy)
    return out


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, impl: str = "auto", softcap: Optional[float] = None):
    """(logp [N], entropy [N] | None) of softmax(logits/τ) at `targets`, float32 (float64 for
    float64 logits). Differentiable on the reference and torch paths; Triton's is no-grad.
    `softcap`: cap the logits first, z ← softcap·tanh(z/softcap) (Gemma 2/3's
    final_logit_softcapping), inside the kernels; None or 0: off."""
    n, _ = check_logits_targets(logits, targets)
    if targets.device != logits.device:
        raise ValueError(f"targets: is on {targets.device} but logits are on {logits.device}")
    softcap = LossConfig(temperature=temperature, softcap=softcap).softcap  # validates τ and the cap, 0 → None
    impl = _resolve_impl(impl, logits, "logprobs")
    if impl == "reference":
        from fastgrpo.kernels.reference import token_logprobs_reference

        logp, ent = token_logprobs_reference(logits, targets, temperature, return_entropy, softcap)
    elif impl == "torch":
        from fastgrpo.kernels.cpu_stream import token_logprobs_torch

        logp, ent = token_logprobs_torch(logits, targets, temperature, return_entropy, softcap=softcap)
    else:
        logp, ent = _triton_backend("logprobs")(logits, targets, temperature, return_entropy, softcap)
    _check_output_finite(logp.detach(), None if ent is None else ent.detach())
    return logp, ent


def fused_linear_grpo_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           advantages: torch.Tensor, mask=None, old_logp=None, ref_logp=None, weights=None,
                           cu_seqlens=None, config: Optional[LossConfig] = None, num_items=None,
                           bias: Optional[torch.Tensor] = None, chunk_size: Optional[int] = None,
                           impl: str = "auto", return_entropy: bool = False) -> LossOutput:
    """The GRPO loss straight from hidden states [N, H] and the lm_head weight [V, H] (+ bias [V]):
    logits = hidden @ weightᵀ + bias are made `chunk_size` tokens at a time and never all at once."""
    config = _check_config(config)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden: expected a float tensor [N, H], got "
                         f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}")
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]
            or weight.dtype != hidden.dtype):
        raise ValueError(f"weight: expected a [V, H={hidden.shape[1]}] tensor of dtype {hidden.dtype} (the lm_head "
                         f"weight), got {tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight!r}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: is on {weight.device} but hidden is on {hidden.device}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (weight.shape[0],)
                             or bias.dtype != hidden.dtype or bias.device != hidden.device):
        raise ValueError(f"bias: expected None or a tensor [V={weight.shape[0]}] of dtype {hidden.dtype} on "
                         f"{hidden.device}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected None or a positive int (tokens per chunk), got {chunk_size!r}")
    n = hidden.shape[0]
    if targets.device != hidden.device:
        raise ValueError(f"targets: is on {targets.device} but hidden is on {hidden.device}")
    # the [N, V] logits are never built, so the shared check runs on a stride-0 stand-in of that shape
    check_logits_targets(hidden.new_zeros(()).expand(n, weight.shape[0]), targets, "hidden@weight.T")
    cu = _validate(n, hidden.device, advantages, mask, old_logp, ref_logp, weights, cu_seqlens, config, num_items)
    # "cce": the single-kernel lm_head + log-probs (kernels/triton/fused_linear.py), fused path only
    impl = impl if impl == "cce" else _resolve_impl(impl, hidden, "fused_linear")
    if impl == "cce" and not (hidden.is_cuda or env.triton_interpret()):
        raise ValueError(f"impl='cce': needs CUDA tensors (got device {hidden.device}), or TRITON_INTERPRET=1")
    kw = dict(bias=bias, mask=mask, old_logp=old_logp, ref_logp=ref_logp, weights=weights, cu_seqlens=cu,
              config=config, num_items=num_items, chunk_size=chunk_size, return_entropy=return_entropy)
    if impl == "reference":
        from fastgrpo.kernels.reference import grpo_loss_reference

        logits = hidden @ weight.t() + (bias if bias is not None else 0)  # capped inside, by config.softcap
        out = grpo_loss_reference(logits, targets, advantages, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                                  weights=weights, cu_seqlens=cu, config=config, num_items=num_items,
                                  return_entropy=return_entropy)
    else:
        from fastgrpo.kernels.fused_linear import fused_linear_loss

        if impl == "triton":
            _triton_backend("logprobs")  # the per-chunk kernels must import: a clear error if not
        out = fused_linear_loss(hidden, weight, targets, advantages, backend=impl, **kw)
    _check_output_finite(out.logp, out.entropy, "hidden@weight.T")
    return out


class FusedLinearGRPOLoss(torch.nn.Module):
    """Module facade: holds the LossConfig and chunking, forwards to `fused_linear_grpo_loss`."""

    def __init__(self, config: Optional[LossConfig] = None, chunk_size: Optional[int] = None, impl: str = "auto"):
        super().__init__()
        self.config, self.chunk_size, self.impl = config or LossConfig(), chunk_size, impl

    def forward(self, hidden, weight, targets, advantages, bias=None, **kw) -> LossOutput:
        return fused_linear_grpo_loss(hidden, weight, targets, advantages, bias=bias, config=self.config,
                                      chunk_size=self.chunk_size, impl=self.impl, **kw)
