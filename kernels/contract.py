"""The loss contract shared by every backend: `LossConfig`, `LossOutput`, input validation and
the O(N) pieces (sequence ids, aggregation weights) that all backends (oracle, CPU streaming
path, Triton) agree on. No O(N·V) math lives here.

It also holds the one autograd boundary of every fast backend, `TokenLogprobsFunction`: a
backend supplies its O(N·V) passes (`LogprobsBackend`: streaming statistics forward, gradient
backward) and the Function, the no-grad shortcut and the in-place rules are shared.

The contract is the one of shared/DESIGN.md ("The loss contract"); field names follow the
public API of the foundation issue.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable, Dict, NamedTuple, Optional

import torch

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")
RATIO_LEVELS = ("token", "sequence")
IMPLS = ("auto", "reference", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class LossConfig:
    temperature: float = 1.0  # τ: logits are divided by it before the softmax (sampling temperature)
    eps_low: float = 0.2  # lower clip: ratio clipped at 1 − eps_low
    eps_high: float = 0.2  # upper clip: 1 + eps_high (DAPO clip-higher uses 0.28)
    dual_clip_c: Optional[float] = None  # dual clip for A < 0: obj ← max(obj, c·A); c > 1 (3.0 typical)
    delta: Optional[float] = None  # δ cap on the unclipped ratio term (TRL's `delta`), > 1 + eps_high
    beta: float = 0.0  # weight of the KL-to-reference term; 0 → no reference needed
    kl: str = "k3"  # KL estimator: k1 = logp−ref, k2 = ½(logp−ref)², k3 = exp(ref−logp)−(ref−logp)−1
    kl_ratio_correction: bool = False  # KL_t ← r_t·KL_t with the ratio before the δ cap (TRL use_bias_correction_kl)
    entropy_coef: float = 0.0  # α: ℓ −= α·H (entropy bonus); needs the entropy pass
    ratio_level: str = "token"  # "token" (PPO/GRPO) or "sequence" (GSPO: exp of the masked mean log-ratio)
    loss_agg: str = "token-mean"  # one of LOSS_AGGS
    max_len: Optional[int] = None  # L_max of seq-mean-token-sum-norm (Dr. GRPO), e.g. max completion length
    # logit soft-capping z ← cap·tanh(z/cap) before 1/τ (Gemma 2/3's final_logit_softcapping); None / 0 = off
    softcap: Optional[float] = None

    def __post_init__(self):
        def bad(name, want):
            raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}: expected {want}")

        if not (isinstance(self.temperature, (int, float)) and self.temperature > 0 and math.isfinite(self.temperature)):
            bad("temperature", "a finite number > 0")
        for name in ("eps_low", "eps_high"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v and math.isfinite(v)):
                bad(name, "a finite number >= 0")
        if self.eps_low >= 1:
            bad("eps_low", "a number in [0, 1) (the lower clip bound 1 − eps_low must stay positive)")
        if self.dual_clip_c is not None and not (self.dual_clip_c > 1):
            bad("dual_clip_c", "None or a number > 1")
        if self.delta is not None and not (self.delta > 1):
            bad("delta", "None or a number > 1")
        if not (isinstance(self.beta, (int, float)) and self.beta >= 0 and math.isfinite(self.beta)):
            bad("beta", "a finite number >= 0")
        if self.kl not in KL_KINDS:
            bad("kl", f"one of {KL_KINDS}")
        if not isinstance(self.entropy_coef, (int, float)) or not math.isfinite(self.entropy_coef):
            bad("entropy_coef", "a finite number")
        if self.ratio_level not in RATIO_LEVELS:
            bad("ratio_level", f"one of {RATIO_LEVELS}")
        if self.loss_agg not in LOSS_AGGS:
            bad("loss_agg", f"one of {LOSS_AGGS}")
        if self.loss_agg == "seq-mean-token-sum-norm" and (self.max_len is None or self.max_len < 1):
            bad("max_len", "a positive int when loss_agg='seq-mean-token-sum-norm' (Dr. GRPO's L_max)")
        if self.max_len is not None and (not isinstance(self.max_len, int) or self.max_len < 1):
            bad("max_len", "None or a positive int")
        if self.softcap is not None:
            if isinstance(self.softcap, bool) or not isinstance(self.softcap, (int, float)) or not (
                    self.softcap >= 0 and math.isfinite(self.softcap)):
                bad("softcap", "None, 0 (off) or a finite number > 0 (the cap of cap·tanh(z/cap))")
            # 0 means off (as Gemma configs write it): one spelling, so that equal configs compare equal
            object.__setattr__(self, "softcap", float(self.softcap) if self.softcap > 0 else None)

    @classmethod
    def field_names(cls):
        return [f.name for f in fields(cls)]


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar; differentiable w.r.t. logits (or hidden / weight on the fused path)
    logp: torch.Tensor  # [N] detached token log-probs at temperature τ (float32, float64 for fp64 input)
    entropy: Optional[torch.Tensor] = None  # [N] detached entropies when asked or when α ≠ 0
    metrics: Dict[str, torch.Tensor] = field(default_factory=dict)  # 0-d detached tensors


def _err(name: str, msg: str):
    raise ValueError(f"{name}: {msg}")


def check_logits_targets(logits: torch.Tensor, targets: torch.Tensor, name: str = "logits"):
    """Shape / dtype / range checks shared by every backend. Returns N, V."""
    if not isinstance(logits, torch.Tensor):
        _err(name, f"expected a torch.Tensor of shape [N, V], got {type(logits).__name__}")
    if logits.dim() != 2:
        _err(name, f"expected shape [N, V] (packed tokens × vocabulary), got {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES:
        _err(name, f"expected a floating dtype (float16, bfloat16, float32, float64), got {logits.dtype}")
    n, v = logits.shape
    if n > 0 and v == 0:
        _err(name, "vocabulary dimension V is 0")
    if not isinstance(targets, torch.Tensor):
        _err("targets", f"expected a torch.Tensor of shape [N], got {type(targets).__name__}")
    if targets.dim() != 1 or targets.shape[0] != n:
        _err("targets", f"expected shape [{n}] (one target per logits row), got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool or targets.is_complex():
        _err("targets", f"expected an integer dtype (int64 or int32), got {targets.dtype}")
    if n > 0:
        lo, hi = torch.stack(torch.aminmax(targets)).tolist()  # one reduction, one host sync
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            _err("targets", f"values must lie in [0, V={v}), found {bad}")
    return n, v


def check_token_vector(x: Optional[torch.Tensor], name: str, n: int, device, allow_bool: bool = False):
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        _err(name, f"expected a torch.Tensor of shape [{n}], got {type(x).__name__}")
    if x.dim() != 1 or x.shape[0] != n:
        _err(name, f"expected shape [{n}] (one value per packed token), got {tuple(x.shape)}")
    if not (x.dtype.is_floating_point or (allow_bool and (x.dtype == torch.bool or not x.is_complex()))):
        _err(name, f"expected a floating dtype, got {x.dtype}")
    if x.device != device:
        _err(name, f"is on {x.device} but logits are on {device}")
    return x


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], n: int) -> torch.Tensor:
    """cu_seqlens [S+1], int, starts at 0, non-decreasing, ends at N. None → one sequence."""
    if cu_seqlens is None:
        return torch.tensor([0, n], dtype=torch.int64)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _err("cu_seqlens", "expected a 1-D integer tensor [S+1] of cumulative sequence lengths (0, …, N)")
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
        _err("cu_seqlens", f"expected an integer dtype, got {cu_seqlens.dtype}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != n:
        _err("cu_seqlens", f"must start at 0 and end at N={n} (cover every packed token), got {int(cu[0])}…{int(cu[-1])}")
    if bool((cu[1:] < cu[:-1]).any()):
        _err("cu_seqlens", "must be non-decreasing")
    return cu


def seq_ids_from_cu(cu: torch.Tensor, device) -> torch.Tensor:
    """[N] sequence index of every packed token."""
    lengths = cu[1:] - cu[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)


def positive_or_one(x: torch.Tensor) -> torch.Tensor:
    """Denominator of a masked mean: the mask sum where it is positive, 1 where it is 0 (the
    numerator is then 0 too, so an empty mean is 0, not NaN). Not clamp(min=1): a fractional
    mask may sum to less than 1 and must still be divided by its sum."""
    return torch.where(x > 0, x, torch.ones_like(x))


def aggregation_weights(mask: torch.Tensor, seq_ids: torch.Tensor, num_seqs: int,
                        config: LossConfig, num_items=None) -> torch.Tensor:
    """[N] weight a_t such that loss = Σ_t a_t·ℓ_t for every aggregation (a_t = 0 off-mask).

    token-mean: m_t / max(Σm, 1) (or / num_items); seq-mean-token-mean: m_t / (S·max(L_i, 1));
    seq-mean-token-sum: m_t / S; seq-mean-token-sum-norm: m_t / (S·L_max).
    Reducing every aggregation to a per-token weight lets one backward kernel serve them all.
    """
    m = mask.to(torch.float64)
    agg = config.loss_agg
    s = max(num_seqs, 1)
    if agg == "token-mean":
        if num_items is not None:
            denom = float(num_items)
            if not denom > 0:
                _err("num_items", f"expected a positive token count, got {num_items}")
        else:
            denom = float(positive_or_one(m.sum()))
        w = m / denom
    elif agg == "seq-mean-token-mean":
        per_seq = torch.zeros(s, dtype=torch.float64, device=m.device).index_add_(0, seq_ids, m)
        w = m / (positive_or_one(per_seq)[seq_ids] * s)
    elif agg == "seq-mean-token-sum":
        w = m / s
    else:
        w = m / (s * float(config.max_len))
    return w


class LogprobsBackend(NamedTuple):
    """The two O(N·V) passes of a backend (CPU streaming torch, or Triton)."""

    # (logits, targets, temperature, need_entropy, softcap | None) -> (logp [N], lse [N], entropy [N] | None),
    # of softmax(c/τ) with c = softcap·tanh(z/softcap) (c = z without a cap)
    stats: Callable
    # (logits, targets, lse, g, h | None, entropy | None, temperature, out | None, softcap | None) ->
    # ∂loss/∂logits (w.r.t. the uncapped z), written into `out` when given (out may be `logits` itself:
    # the in-place gradient)
    grad: Callable


class TokenLogprobsFunction(torch.autograd.Function):
    """(logits [N, V], targets [N]) → (logp [N], entropy [N] or empty).

    The autograd boundary sits at the log-probs: the O(N) objective on top (objective.py) is
    ordinary differentiable torch, whose backward delivers g_t = ∂loss/∂logp_t and
    h_t = ∂loss/∂H_t, from which the backend's gradient pass writes
    ∂loss/∂z = (g·(onehot − p) − h·p·(log p + H))/τ in one read of the logits (times
    1 − tanh²(z/cap) with a soft cap: the gradient w.r.t. the uncapped logits)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, need_entropy, inplace, backend, softcap=None):
        logp, lse, ent = backend.stats(logits, targets, temperature, need_entropy, softcap)
        ctx.save_for_backward(logits, targets, lse, ent if ent is not None else lse.new_empty(0))
        ctx.temperature, ctx.need_entropy, ctx.inplace, ctx.backend = temperature, need_entropy, inplace, backend
        ctx.softcap = softcap
        if ent is None:
            ent = lse.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        h = g_ent if (ctx.need_entropy and g_ent is not None) else None
        grad = ctx.backend.grad(logits, targets, lse, g_logp, h, ent if h is not None else None, ctx.temperature,
                                logits if ctx.inplace else None, ctx.softcap)
        return grad, None, None, None, None, None, None


def differentiable_logprobs(backend: LogprobsBackend, logits: torch.Tensor, targets: torch.Tensor,
                            temperature: float, return_entropy: bool, inplace_backward: bool,
                            softcap: Optional[float] = None):
    """(logp, entropy | None) through `backend`, differentiable when the logits need a gradient.
    `softcap`: the cap of cap·tanh(z/cap) applied to the logits inside the backend (None: off).

    A leaf (a user's tensor or a parameter) is never overwritten in place: its values would be
    lost and its .grad would alias them. In place is for activations (the lm_head output)."""
    if not (logits.requires_grad and torch.is_grad_enabled()):
        with torch.no_grad():
            logp, _, ent = backend.stats(logits, targets, temperature, return_entropy, softcap)
        return logp, ent
    inplace = bool(inplace_backward) and not logits.is_leaf
    logp, ent = TokenLogprobsFunction.apply(logits, targets, float(temperature), bool(return_entropy), inplace,
                                            backend, softcap)
    return logp, (ent if return_entropy else None)
