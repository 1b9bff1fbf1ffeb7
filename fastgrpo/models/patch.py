"""The one place that changes a model's classes for speed, and changes them back.

`patch_model(model)` swaps in, where they apply (float32 on CPU; each one checks and steps aside
per call otherwise): oneDNN linears (`onednn.use_onednn_linears`: AVX-512 GEMMs where MKL runs
AVX2) and fused decoder layers (`fused_layer.use_fused_layers`: a packed training forward's
layer as a few C++ loops). Both keep the parameters, hooks and state dict: a patched model saves,
loads and syncs like the original. `unpatch_model(model)` undoes both; the backend calls it
where the patches cannot work (off CPU, ZeRO-3's per-submodule gathering hooks).
The packed attention (`packed.enable_packed_attention`) is not a class swap but a registered
attention function, installed by the packed forward itself.
"""
from __future__ import annotations

from typing import Dict

import torch.nn as nn

from fastgrpo.models.fused_layer import restore_layers, use_fused_layers
from fastgrpo.models.onednn import restore_linears, use_onednn_linears


def patch_model(model: nn.Module) -> Dict[str, int]:
    """Swap fastgrpo's fast paths into `model` in place; returns how many modules each swapped."""
    return {"onednn_linears": use_onednn_linears(model), "fused_layers": use_fused_layers(model)}


def unpatch_model(model: nn.Module) -> Dict[str, int]:
    """Undo `patch_model` (a no-op on a model it never patched); returns how many it restored."""
    return {"onednn_linears": restore_linears(model), "fused_layers": restore_layers(model)}
