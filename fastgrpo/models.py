"""Packed (padding-free) forward of Hugging Face causal LMs for GRPO training.

All sequences of a `PackedBatch` run as one row `[1, T]` with position ids restarting at each
sequence, and attention must not cross sequence boundaries:

- flash-attention models (`attn_implementation="flash_attention_2"`/`_3`, GPU): transformers'
  varlen path, fed `cu_seq_lens_q/k` and `max_length_q/k` directly (transformers ≥ 4.53 /
  5.x `_flash_attention_forward`, the "padding free" case), so nothing is inferred from
  position ids and no mask is built: the layout of TRL's padding-free training and verl's
  remove-padding.
- everything else (sdpa / eager, CPU): `attn="varlen"` (default) swaps in, for the duration of
  the call, an attention function registered in transformers' `AttentionInterface` that reads
  the same `cu_seq_lens_q` kwarg and runs causal SDPA per sequence — exact, O(Σ L²) work and
  no T×T mask. `attn="mask"` instead relies on transformers' own packed-sequence detection
  (`masking_utils.find_packed_sequence_indices`: a position that does not follow its
  predecessor by 1 starts a sequence) which builds a block-diagonal causal mask of T×T; that
  detection is skipped whenever a KV cache exists, hence `use_cache=False` on every call here.
  Departure from flash-attn: sliding-window layers are not supported by "varlen" (ValueError).

Only the hidden states at `PackedBatch.logit_index` (positions whose next token is a completion
token) are returned / sent through the lm_head, so prompt tokens never produce logits and a
fused linear + loss kernel can take the hidden states directly.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .packing import PackedBatch

VARLEN_ATTN = "fastgrpo_varlen_sdpa"
_FLASH_PREFIXES = ("flash_attention", "kernels-community/flash", "kernels-community/vllm-flash")


def _varlen_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           sliding_window=None, **kwargs):
    """Causal SDPA per packed sequence. query [1, Hq, T, D], key/value [1, Hkv, T, D];
    returns ([1, T, Hq, D], None) like transformers' attention functions."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError(f"attention '{VARLEN_ATTN}' needs cu_seq_lens_q (call it through "
                         "fastgrpo.models.packed_forward)")
    if sliding_window is not None:
        raise ValueError(f"sliding_window={sliding_window}: the CPU varlen attention does not "
                         "implement sliding windows; use packed_forward(..., attn='mask')")
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got query of shape {tuple(query.shape)}")
    bounds = cu.tolist()
    p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for s in range(len(bounds) - 1):
        a, b = bounds[s], bounds[s + 1]
        if b == a:
            continue
        outs.append(F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                   dropout_p=p, is_causal=True, scale=scaling,
                                                   enable_gqa=gqa))
    out = torch.cat(outs, dim=2) if outs else query.new_zeros(query.shape)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    if VARLEN_ATTN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_ATTN, _varlen_sdpa_attention)


def _is_flash(impl: Optional[str]) -> bool:
    return bool(impl) and impl.startswith(_FLASH_PREFIXES)


class _attn_implementation:
    """Temporarily switch a model config's attention implementation (restored on exit)."""

    def __init__(self, config, impl: str):
        self.config, self.impl = config, impl

    def __enter__(self):
        self.saved = self.config._attn_implementation
        self.config._attn_implementation = self.impl

    def __exit__(self, *exc):
        self.config._attn_implementation = self.saved


def _check_batch(batch) -> None:
    if not isinstance(batch, PackedBatch):
        raise ValueError(f"batch: expected a fastgrpo.packing.PackedBatch, got {type(batch).__name__}")


def packed_hidden_states(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Last hidden states (after the final norm) of every packed token: `[T, H]`."""
    _check_batch(batch)
    if attn not in ("auto", "varlen", "mask"):
        raise ValueError(f"attn={attn!r}: expected 'auto', 'varlen' or 'mask'")
    device = model.get_input_embeddings().weight.device
    ids = batch.input_ids.to(device)[None]
    pos = batch.position_ids.to(device)[None]
    base = model.base_model
    impl = model.config._attn_implementation
    if _is_flash(impl):
        cu = batch.cu_seqlens.to(device=device, dtype=torch.int32)
        out = base(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    elif attn == "mask":
        # transformers detects the restarts in position_ids and builds a block-diagonal mask
        out = base(input_ids=ids, position_ids=pos, use_cache=False)
    else:
        _register()
        cu = batch.cu_seqlens.to(torch.int64)  # read on the host by the per-sequence loop
        with _attn_implementation(model.config, VARLEN_ATTN):
            out = base(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=batch.max_seqlen, max_length_k=batch.max_seqlen)
    return out.last_hidden_state[0]


def packed_forward(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Hidden states `[N, H]` at the positions that predict completion tokens
    (`batch.logit_index`), in packed order: row n times the lm_head weight gives the logits of
    `batch.targets[n]`. Feed them to a fused linear + loss kernel, or use `packed_logits`.

    `model`: any HF causal LM (Qwen2, Llama, …) exposing `base_model` and
    `get_output_embeddings()`. `attn`: "auto" (flash varlen when the model uses flash
    attention, else "varlen"), "varlen" or "mask" — see the module docstring.
    """
    h = packed_hidden_states(model, batch, attn)
    return h[batch.logit_index.to(h.device)]


def _lm_head(model):
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, name, None) not in (None, 1.0):
            raise ValueError(f"{type(model).__name__} config.{name}={getattr(model.config, name)}: "
                             "packed_logits applies the lm_head only; post-processing of logits is not supported")
    return head


def packed_logits(model, batch: PackedBatch, attn: str = "auto") -> torch.Tensor:
    """Logits `[N, V]` of the completion tokens only (lm_head on `packed_forward` rows)."""
    return _lm_head(model)(packed_forward(model, batch, attn))


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
