"""Packed (padding-free) forward of Hugging Face causal LMs for GRPO training.

All sequences of a `PackedBatch` run as one row `[1, T]` with position ids restarting at each
sequence, and attention must not cross sequence boundaries:

- flash-attention models (`attn_implementation="flash_attention_2"`/`_3`, GPU): transformers'
  varlen path, fed `cu_seq_lens_q/k` and `max_length_q/k` directly (transformers ≥ 4.53 /
  5.x `_flash_attention_forward`, the "padding free" case), so nothing is inferred from
  position ids and no mask is built: the layout of TRL's padding-free training and verl's
  remove-padding.
- sdpa / eager models (CPU): `attn="varlen"` (default) switches the model, once and for good,
  to the attention implementation "fastgrpo_varlen_sdpa" registered in transformers'
  `AttentionInterface`: given the same `cu_seq_lens_q` kwarg as flash-attn it runs causal SDPA
  per sequence, sequences of similar length gathered into one right-padded SDPA call (exact
  under the causal mask, see `VarlenPlan`) — O(Σ L²) work plus bounded padding, no T×T mask;
  called without it (an ordinary padded forward, `generate`) it is plain SDPA with SDPA's mask.
  The switch is not undone after the call on purpose: with gradient checkpointing the layers run
  again during backward, and they must dispatch the same way then. `attn="mask"` instead relies
  on transformers' own packed-sequence detection (`masking_utils.find_packed_sequence_indices`:
  a position that does not follow its predecessor by 1 starts a sequence), which builds a T×T
  block-diagonal causal mask; that detection is skipped whenever a KV cache exists, hence
  `use_cache=False` on every call here. Departure from flash-attn: "varlen" runs a sliding window
  only where it covers every packed sequence (then it masks nothing; else a ValueError naming the
  model type). Attention-score soft-capping (Gemma 2's `attn_logit_softcapping`, which SDPA cannot
  do) takes the baddbmm path for every bucket, capped as transformers' eager attention does.

float32 CPU models built by `build_model` run their linears on oneDNN (`fastgrpo.models.onednn`), which
compiles one kernel per row count: their packed row is padded to the next count on a short ladder
with tokens past the last segment, which attend nothing (output 0, checked against
`cu_seq_lens_q` through a `fastgrpo_pad_rows` kwarg) and are cut off before anything is returned.

The forward always goes through the model object given (a DDP / DeepSpeed wrapper's hooks run).
Only the rows at `PackedBatch.logit_index` (positions whose next token is a completion token)
are returned / sent through the lm_head (`logits_to_keep`), so prompt tokens never produce
logits and a fused linear + loss kernel can take the hidden states directly.

The bucket plan of the varlen attention (`VarlenPlan`) lives in `fastgrpo.models.varlen_plan`.
"""
from __future__ import annotations

import contextvars
from typing import Optional

import torch
import torch.nn.functional as F

from fastgrpo.models.onednn import ONEDNN_ATTR, padded_rows
from fastgrpo.models.varlen_plan import VarlenPlan, tensor_version  # noqa: F401  (tensor_version: re-exported)
from fastgrpo.packing.layout import PackedBatch

VARLEN_ATTN = "fastgrpo_varlen_sdpa"
# The forward kwarg carrying `PackedBatch.segment_prefix` to the varlen attention (through the
# model's **kwargs, like cu_seq_lens_q, so a checkpointed recomputation receives it too).
PREFIX_KWARG = "fastgrpo_segment_prefix"
# The forward kwarg carrying how many ladder-padding rows follow the last segment (cpu_gemm)
PAD_KWARG = "fastgrpo_pad_rows"
_FLASH_PREFIXES = ("flash_attention", "kernels-community/flash", "kernels-community/vllm-flash")
_SWITCHABLE = ("sdpa", "eager", VARLEN_ATTN)
# Set while _run runs the model: the mask builder then returns no mask (the
# varlen attention needs none) instead of a T×T block-diagonal one. Masks are built once per
# forward outside the layers, so checkpoint recomputation never consults this flag.
PACKED_CALL = contextvars.ContextVar("fastgrpo_packed_call", default=False)

# One SDPA call (forward + backward) costs about this many query·key·(heads × head dim)
# products of causal attention work (see `fastgrpo.models.varlen_plan.VarlenPlan`).
_CALL_COST = 150_000
# The last plan built: every layer of one forward (and a checkpointed recomputation) is given
# the same `cu` tensor object, so the plan is built once per forward, not once per layer.
_LAST_PLAN: list = [None]


def _plan_for(cu: torch.Tensor, device, width: int, prefix: Optional[torch.Tensor] = None) -> VarlenPlan:
    """`width`: query heads × head dim (the attention work per query·key pair)."""
    plan = _LAST_PLAN[0]
    if (plan is None or plan.cu is not cu or plan.version is None or plan.version != tensor_version(cu)
            or plan.device != device or plan.width != width or plan.prefix is not prefix
            or (prefix is not None and (plan.prefix_version is None or plan.prefix_version != tensor_version(prefix)))):
        plan = _LAST_PLAN[0] = VarlenPlan(cu, device, width, prefix, _CALL_COST)
    return plan


# Buckets up to this length take `_short_causal_attention` on CPU instead of SDPA's flash
# kernel. Measured forward + backward on one thread ([n, Hq, L, D] with about 2k tokens, GQA
# 2:1): L = 38 1.54 vs 2.00 ms (D 32) and 12.0 vs 14.9 ms (8 heads, D 64); L = 128 ties; L =
# 512 SDPA wins (11.6 vs 13.3 ms), as its tiles skip the masked half.
_MATH_MAX_LEN = 64
# Prefixed buckets (shared-prompt completions, explicit mask: SDPA cannot skip the masked half
# either) take the baddbmm path up to this many keys.
_MATH_MAX_KEYS = 256
_CAUSAL_BIAS: dict = {}


def _short_causal_attention(q, k, v, scaling, bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                            dropout: float = 0.0):
    """Causal attention as baddbmm (scale + causal bias + QK^T) → softmax → bmm, for short
    sequences. q [n, Hq, Lq, D], k / v [n, Hkv, Lk, D] (any strides) → [n, Hq, Lq, D]. The query
    heads sharing a KV head are the rows of one matrix, so GQA repeats nothing. `bias`: an
    additive mask [n·Hkv, g·Lq, Lk] (default: causal, Lq = Lk). float32 only: the scores are
    rounded to the input dtype (the caller sends half-precision models to SDPA). `softcap`:
    scores ← cap·tanh(scores/cap) before the mask (Gemma 2), for any length and dtype (half
    precision is upcast to float32 for it)."""
    if softcap is not None and q.dtype in (torch.float16, torch.bfloat16):
        return _short_causal_attention(q.float(), k.float(), v.float(), scaling, bias, softcap, dropout).to(q.dtype)
    n, hq, L, d = q.shape
    hk, Lk = k.shape[1], k.shape[2]
    g = hq // hk
    if bias is None:
        key = (L, g, q.dtype, q.device)
        bias = _CAUSAL_BIAS.get(key)
        if bias is None:
            bias = torch.full((L, L), float("-inf"), dtype=q.dtype, device=q.device).triu_(1).repeat(g, 1)
            _CAUSAL_BIAS[key] = bias
    scale = scaling if scaling is not None else d ** -0.5
    qq = q.reshape(n * hk, g * L, d)
    kk, vv = k.reshape(n * hk, Lk, d), v.reshape(n * hk, Lk, d)
    if softcap is None:
        att = torch.baddbmm(bias, qq, kk.transpose(1, 2), alpha=scale).softmax(-1)
    else:  # transformers' eager order: scale, /cap, tanh, ·cap, then the mask
        att = (torch.tanh(torch.bmm(qq, kk.transpose(1, 2)) * scale / softcap) * softcap + bias).softmax(-1)
    if dropout:
        att = F.dropout(att, dropout)
    return torch.bmm(att, vv).view(n, hq, L, d)


def _capped_attention(query, key, value, attention_mask, scaling, softcap: float, dropout: float):
    """Unpacked attention (e.g. `generate`) with score soft-capping, which SDPA cannot do: scores
    capped, then the mask SDPA would get (bool keep-mask, additive, or None = causal), as
    transformers' eager attention. query [B, Hq, Lq, D], key / value [B, Hkv, Lk, D] → [B, Lq, Hq, D]."""
    g = query.shape[1] // key.shape[1]
    k, v = (x.repeat_interleave(g, dim=1) if g > 1 else x for x in (key, value))
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, k.transpose(2, 3))
    s = torch.tanh(s.to(torch.promote_types(s.dtype, torch.float32)) * scale / softcap) * softcap
    lq, lk = s.shape[-2:]
    if attention_mask is None:  # causal, queries at the last Lq key positions
        keep = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril_(lk - lq)
        s = s.masked_fill(~keep, float("-inf"))
    elif attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask, float("-inf"))
    else:
        s = s + attention_mask
    p = F.dropout(s.softmax(-1), dropout) if dropout else s.softmax(-1)
    return torch.matmul(p.to(v.dtype), v).transpose(1, 2).contiguous()


def _varlen_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           sliding_window=None, **kwargs):
    """Causal SDPA per packed sequence when `cu_seq_lens_q` is given (sequences of similar
    length batched into one padded call, see `VarlenPlan`), else transformers' SDPA.
    query [1, Hq, T, D], key/value [1, Hkv, T, D]; returns ([1, T, Hq, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    softcap = kwargs.pop("softcap", None)  # Gemma 2's attn_logit_softcapping
    p = dropout if module.training else 0.0
    if cu is None:
        if softcap is not None:  # SDPA would drop the cap (the mask carries any sliding window)
            return _capped_attention(query, key, value, attention_mask, scaling, softcap, p), None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    _, hq, T, d = query.shape
    plan = _plan_for(cu, query.device, hq * d, kwargs.get(PREFIX_KWARG))
    if T != plan.unpad.numel() + kwargs.get(PAD_KWARG, 0):
        raise ValueError(f"cu_seq_lens_q ends at token {plan.unpad.numel()} but the query has {T} rows "
                         f"({kwargs.get(PAD_KWARG, 0)} of them ladder padding): they must agree")
    if not plan.buckets:
        return query.new_zeros(1, T, hq, d), None
    longest = max(b[4] for b in plan.buckets)  # keys of the longest segment (its prefix included)
    if sliding_window is not None and longest > sliding_window:
        kind = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise ValueError(f"sliding_window={sliding_window}: this {kind} model's sliding-window layers would mask "
                         f"part of a {longest}-token packed sequence, which the CPU varlen attention does not "
                         "implement (it runs windows that cover every sequence); use shorter sequences or "
                         "packed_forward(..., attn='mask')")
    hk = key.shape[1]
    gqa = hq != hk
    # token-major [T, H, D] views (the projections' own layout in HF models): gathering whole
    # rows, and index_add of whole rows in the backward, is ~20% faster than along dim 1
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    outs = []
    for b, (q_idx, k_idx, n, Lq, Lk, keep) in enumerate(plan.buckets):
        def pad(x, idx, L):  # [T, H, D] → [n, H, L, D] (strided: SDPA's CPU kernel takes any strides)
            return x.index_select(0, idx).view(n, L, x.shape[1], d).transpose(1, 2)

        qb, kb, vb = pad(q, q_idx, Lq), pad(k, k_idx, Lk), pad(v, k_idx, Lk)
        # baddbmm rounds the scores to the input dtype before the softmax, SDPA keeps them in
        # float32: half-precision models stay on SDPA
        math_ok = p == 0.0 and query.device.type == "cpu" and query.dtype == torch.float32
        if softcap is not None:  # SDPA cannot cap the scores: the baddbmm path at every length
            bias = None if keep is None else plan.bias(b, torch.float32, hq // hk, hk)
            o = _short_causal_attention(qb, kb, vb, scaling, bias, softcap, p)
        elif keep is None and Lq <= _MATH_MAX_LEN and math_ok:
            o = _short_causal_attention(qb, kb, vb, scaling)
        elif keep is None:
            o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=p, is_causal=True, scale=scaling,
                                               enable_gqa=gqa)
        elif Lk <= _MATH_MAX_KEYS and math_ok:
            o = _short_causal_attention(qb, kb, vb, scaling, plan.bias(b, qb.dtype, hq // hk, hk))
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=plan.bias(b, qb.dtype), dropout_p=p,
                                               scale=scaling, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(n * Lq, hq, d))
    if T > plan.unpad.numel():  # ladder padding past the last segment: attends nothing, output 0
        outs.append(query.new_zeros(1, hq, d))
    flat = outs[0] if len(outs) == 1 else torch.cat(outs)
    return flat.index_select(0, plan.rows(T))[None], None


def _varlen_mask(*args, **kwargs):
    from transformers.masking_utils import sdpa_mask

    return None if PACKED_CALL.get() else sdpa_mask(*args, **kwargs)


def _is_flash(impl: Optional[str]) -> bool:
    return bool(impl) and impl.startswith(_FLASH_PREFIXES)


def enable_packed_attention(model) -> str:
    """Prepare `model` for packed forwards; returns the attention implementation it will use.

    Flash-attention models are left alone (their varlen path is used). sdpa / eager models are
    switched to "fastgrpo_varlen_sdpa" (plain SDPA unless called by `packed_forward`); any other
    implementation raises ValueError (use `attn="mask"` for those). Called by `packed_forward`;
    call it yourself before enabling gradient checkpointing or wrapping the model (DDP/FSDP).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    impl = model.config._attn_implementation
    if _is_flash(impl):
        return impl
    if impl not in _SWITCHABLE:
        raise ValueError(f"attn_implementation={impl!r}: packed 'varlen' attention supports flash "
                         "attention, sdpa and eager; use packed_forward(..., attn='mask')")
    if VARLEN_ATTN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTN, _varlen_sdpa_attention)
        AttentionMaskInterface.register(VARLEN_ATTN, _varlen_mask)
    model.config._attn_implementation = VARLEN_ATTN
    return VARLEN_ATTN


def can_share_prefix(model) -> bool:
    """Whether packed forwards of `model` should take the shared-prefix layout: CPU models on
    the varlen attention (whose cost model `packed.shares_prefix` was measured on). Flash
    attention cannot run the layout; on GPU the prefixed buckets would need a dense mask per
    bucket that nothing here has measured, so GPU models pack unshared."""
    hf = _unwrap(model)
    return not _is_flash(hf.config._attn_implementation) and hf.get_input_embeddings().weight.device.type == "cpu"


def packing_attn_coef(model) -> float:
    """`a` of the packing cost model a·L + L² for `model` (≈ 6 · hidden size)."""
    from fastgrpo.packing.bins import DEFAULT_ATTN_COEF

    hidden = getattr(_unwrap(model).config, "hidden_size", None)
    return 6.0 * hidden if hidden else float(DEFAULT_ATTN_COEF)


def _check_batch(batch) -> None:
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"batch: expected a fastgrpo.packing.bins.PackedBatch, got {type(batch).__name__}")


def _unwrap(model):
    """The HF model inside DDP / DeepSpeed-style wrappers (for its config and embeddings)."""
    while hasattr(model, "module") and not hasattr(model, "config"):
        model = model.module
    return model


def _run(model, batch: PackedBatch, attn: str, keep: Optional[torch.Tensor], hidden: bool):
    """One forward of the packed row through `model` itself (so a DDP / DeepSpeed wrapper's
    hooks run), with lm_head rows restricted to `keep` (transformers' `logits_to_keep`)."""
    _check_batch(batch)
    if attn not in ("auto", "varlen", "mask"):
        raise ValueError(f"attn={attn!r}: expected 'auto', 'varlen' or 'mask'")
    hf = _unwrap(model)
    device = hf.get_input_embeddings().weight.device
    if keep is None:
        keep = torch.zeros(0, dtype=torch.int64)  # no lm_head rows: the caller applies it
    kw = dict(input_ids=batch.input_ids.to(device)[None], position_ids=batch.position_ids.to(device)[None],
              use_cache=False, logits_to_keep=keep.to(device), output_hidden_states=hidden)
    shared = getattr(batch, "segment_prefix", None) is not None
    if shared and (_is_flash(hf.config._attn_implementation) or attn == "mask"):
        what = "flash attention" if attn != "mask" else "attn='mask'"
        raise ValueError(f"this batch has the shared-prefix layout, which {what} cannot run: build it with "
                         "share_prefix=False (the trainer does so for flash-attention models)")
    if _is_flash(hf.config._attn_implementation):
        cu = batch.cu_seqlens.to(device=device, dtype=torch.int32)
        return model(**kw, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                     max_length_k=batch.max_seqlen)
    if attn == "mask":
        # transformers detects the restarts in position_ids and builds a block-diagonal mask
        return model(**kw)
    enable_packed_attention(hf)
    cu = batch.cu_seqlens.to(torch.int64)  # read on the host by the per-sequence loop
    t = kw["input_ids"].shape[1]
    # (the dtype is read here, not at the swap: a model may be cast after build_model)
    onednn = (getattr(hf, ONEDNN_ATTR, False) and device.type == "cpu" and not torch.is_autocast_enabled("cpu")
              and hf.get_input_embeddings().weight.dtype == torch.float32)
    tp = padded_rows(t) if onednn else t
    if tp > t:
        # float32 CPU linears run on oneDNN for row counts on its shape ladder (cpu_gemm): the row
        # is padded to it with tokens past the last segment, which the varlen attention leaves
        # out (output 0) and no caller reads (logits_to_keep < T; hidden states are cut to T)
        kw["input_ids"] = F.pad(kw["input_ids"], (0, tp - t))
        kw["position_ids"] = F.pad(kw["position_ids"], (0, tp - t))
        kw[PAD_KWARG] = tp - t
    if shared:
        kw[PREFIX_KWARG] = batch.segment_prefix.cpu()
    token = PACKED_CALL.set(True)
    try:
        return model(**kw, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=batch.max_seqlen,
                     max_length_k=batch.max_seqlen)
    finally:
        PACKED_CALL.reset(token)


def packed_hidden_states(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Last hidden states (after the final norm) of every packed token: `[T, H]`."""
    return _run(model, batch, attn, keep=None, hidden=True).hidden_states[-1][0, :batch.input_ids.numel()]


def packed_forward(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Hidden states `[N, H]` at the positions that predict completion tokens
    (`batch.logit_index`), in packed order: row n times the lm_head weight gives the logits of
    `batch.targets[n]`. Feed them to a fused linear + loss kernel, or use `packed_logits`
    (which also applies any logit post-processing of the model, e.g. soft-capping).

    `model`: any HF causal LM (Qwen2, Llama, …), bare or inside a DDP / DeepSpeed wrapper (the
    forward goes through the wrapper). `attn`: "auto" (flash varlen when the model uses flash
    attention, else "varlen"), "varlen" or "mask" — see the module docstring.
    """
    h = packed_hidden_states(model, batch, attn)
    return h[batch.logit_index.to(h.device)]


def head_softcap(model) -> Optional[float]:
    """Gemma 2/3's `final_logit_softcapping` of `model` (None when absent or 0): the cap the loss
    kernels apply themselves (`LossConfig.softcap`) to `lm_head_logits(..., softcap=False)`."""
    cap = getattr(_unwrap(model).config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def lm_head_logits(model, hidden: torch.Tensor, softcap: bool = True) -> torch.Tensor:
    """The lm_head applied to `hidden` with the logit post-processing that the model's own forward
    applies after it, so that a loss computed from `packed_forward` hidden states sees the same
    distribution as `packed_logits`, the rollout engine and old / reference scoring: Granite's
    `logits_scaling` (divides), Cohere's `logit_scale` (multiplies), Gemma 2/3's
    `final_logit_softcapping` (cap·tanh(z/cap)). `softcap=False` leaves the cap out, for a loss
    or scorer that applies `head_softcap(model)` inside its kernels (no capped [N, V] copy)."""
    hf = _unwrap(model)
    logits = hf.get_output_embeddings()(hidden)
    cfg = hf.config
    div = getattr(cfg, "logits_scaling", None)
    if div not in (None, 1, 1.0):
        logits = logits / div
    mul = getattr(cfg, "logit_scale", None)
    if mul not in (None, 1, 1.0):
        logits = logits * mul
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap and softcap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def packed_head_logits(model, batch: PackedBatch, attn: str = "auto"):
    """(logits [N, V], cap | None) for scoring: `packed_logits` for a model without a final-logit
    cap; for a capped one (Gemma 2/3) the uncapped head logits and the cap, to be applied by the
    kernels (`token_logprobs(..., softcap=cap)`) exactly as the trainer's loss applies it, so old /
    reference log-probs equal the loss's at step 0 (the model's own head caps in its dtype: a bf16
    model rounds the capped logits once more)."""
    cap = head_softcap(model)
    if cap is None:
        return packed_logits(model, batch, attn), None
    return lm_head_logits(model, packed_forward(model, batch, attn), softcap=False), cap


def packed_logits(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Logits `[N, V]` of the completion tokens only: the model's own forward with
    `logits_to_keep=batch.logit_index`, so the lm_head runs on those N rows and nowhere else."""
    return _run(model, batch, attn, keep=batch.logit_index, hidden=False).logits[0]


def packed_logprobs(model, batch: PackedBatch, temperature: float = 1.0, attn: str = "auto") -> torch.Tensor:
    """Log-probs `[N]` (float32) of `batch.targets` under `softmax(logits / temperature)`.

    Convenience path: materialises `[N, V]` float32 log-softmax; the trainer's loss should take
    `packed_forward` hidden states (fused linear loss) or `packed_logits` instead.
    """
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r}: expected a number > 0")
    logits = packed_logits(model, batch, attn).float() / temperature
    targets = batch.targets.to(logits.device)
    return logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
