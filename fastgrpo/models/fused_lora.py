"""The LoRA half of the fused CPU decoder layers (fastgrpo.models.fused_layer): a PEFT LoRA'd
projection y = W x + s·B A x computed as the layer's base GEMM plus the low-rank product as two
small GEMMs (x Aᵀ: [T, r], then · Bᵀ), and in the backward s·(g B) as [T, r], the adapter's
gradients dA = (s·g B)ᵀ x, dB = s·gᵀ (x Aᵀ) and its share (s·g B) A of the input gradient — the
base weight's gradient GEMM is skipped (it is frozen), so a LoRA layer's backward costs less than
a full one. Follows LoRA (Hu et al. 2021) as PEFT computes it (`lora_B(lora_A(dropout(x))) ·
scaling`), with the departure that dropout on the adapter's input is not taken (PEFT's layers
run then, said once); the sums round differently (float32), within the oracle's bound
(tests/models/test_lora_fused.py against the float64 model).
"""
from __future__ import annotations

import torch

from fastgrpo.models.lora import lora_terms


def lora_forward(out: torch.Tensor, x: torch.Tensor, terms, cols) -> None:
    """out[:, c0:c1] += s·(x Aᵀ) Bᵀ for each adapter (A [r, K], B [N, r], s) of a projection group
    whose outputs sit in columns `cols` of `out`: two small GEMMs each (r ≪ K, N)."""
    for t, (c0, c1) in zip(terms, cols):
        if t is not None:
            a, b, scale = t
            out[:, c0:c1].addmm_(torch.mm(x, a.t()), b.t(), alpha=scale)


def lora_backward(g: torch.Tensor, x: torch.Tensor, terms, cols, dx: torch.Tensor, grads: list, at: int) -> None:
    """Backward of `lora_forward` given the group's output gradient g [T, N]: dx += Σ s·(g_j B) A and
    grads[at + 2j], grads[at + 2j + 1] = the gradients of A_j and B_j (the base weight gets none)."""
    for j, (t, (c0, c1)) in enumerate(zip(terms, cols)):
        if t is None:
            continue
        a, b, scale = t
        gj = g[:, c0:c1]
        v = torch.mm(gj, b).mul_(scale)  # [T, r]
        grads[at + 2 * j] = torch.mm(v.t(), x)  # dA = s·Bᵀ gᵀ x
        grads[at + 2 * j + 1] = torch.mm(gj.t(), torch.mm(x, a.t())).mul_(scale)  # dB = s·gᵀ (x Aᵀ)
        dx.addmm_(v, a)


def group_terms(lw, scales, lo: int, hi: int):
    """The (A, B, scale) of projections lo..hi-1 (q k v o gate up down) from the flat A / B args."""
    return tuple(None if scales[i] is None else (lw[2 * i], lw[2 * i + 1], scales[i]) for i in range(lo, hi))


def lora_columns(widths) -> tuple:
    """(start, end) column spans of consecutive blocks of these widths."""
    out, at = [], 0
    for w in widths:
        out.append((at, at + w))
        at += w
    return tuple(out)


def base_linear(m):
    """The linear a projection computes with: itself, or the base layer of a PEFT LoRA wrapper
    (whose adapter the fused path adds itself, `lora_args`)."""
    return m.base_layer if hasattr(m, "lora_A") and hasattr(m, "base_layer") else m


def lora_modules(mods) -> list:
    """The PEFT wrappers among projections `mods` with their base layers and adapter modules: what
    the fused path computes without calling (a hook on any of them would be skipped)."""
    out = []
    for m in mods:
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):
            out += [m, m.base_layer, *m.lora_A.values(), *m.lora_B.values()]
    return out


def lora_args(mods):
    """(scales, flat A / B list) of a layer's seven projections `mods` (q k v o gate up down) for
    `_DecoderLayerFn` (scales None: no adapter on), or a reason the fused path cannot take an
    adapter here."""
    scales, flat = [], []
    for m in mods:
        _, terms, why = lora_terms(m)
        if why is not None:
            return None, None, why
        scales.append(None if terms is None else terms[2])
        flat += [None, None] if terms is None else [terms[0], terms[1]]
    if all(sc is None for sc in scales):
        return None, [], None
    return tuple(scales), flat, None
