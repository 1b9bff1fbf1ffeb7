"""Direct weight sync for the built-in torch engine: the engine either shares the trainer's
module (nothing to do) or holds its own copy, updated by an in-place `copy_` per parameter
(cast to the engine's dtype / device). Unknown and missing names are rejected like the
bucketed path does."""
from __future__ import annotations

import time
from typing import Iterable, Tuple

import torch

from fastgrpo.sync.sender import SyncStats, check_names


@torch.no_grad()
def copy_weights(target: torch.nn.Module, named: Iterable[Tuple[str, torch.Tensor]]) -> SyncStats:
    t0 = time.perf_counter()
    params = dict(target.named_parameters())
    named = list(named)
    check_names([n for n, _ in named], params)
    nbytes = 0
    for name, src in named:
        dst = params[name]
        if dst is src:
            continue
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"parameter {name!r}: engine shape {tuple(dst.shape)}, got {tuple(src.shape)}")
        dst.copy_(src.detach())
        nbytes += dst.numel() * dst.element_size()
    return SyncStats(time.perf_counter() - t0, nbytes, 1)
