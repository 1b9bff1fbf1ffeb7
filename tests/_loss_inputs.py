"""Random packed GRPO-loss inputs shared by the loss tests (not a test module)."""
from __future__ import annotations

import torch


def make_inputs(n: int, v: int, dtype=torch.float64, seed: int = 0, n_seqs: int = 4, spread: float = 0.3,
                fully_masked_seq: bool = True):
    """Logits [N, V], targets, advantages, mask, old/ref log-probs near the current policy (so the
    ratios straddle the clip bounds), positive weights, and cu_seqlens with an empty sequence, a
    length-1 sequence and (optionally) a fully masked one when N allows."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    logp = torch.log_softmax(logits.double(), -1).gather(1, targets.unsqueeze(1)).squeeze(1) if n else torch.zeros(0, dtype=torch.float64)
    old = logp + spread * torch.randn(n, generator=g, dtype=torch.float64)
    ref = logp + spread * torch.randn(n, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    mask = (torch.rand(n, generator=g) > 0.2).to(torch.float64)
    # sequence boundaries: [0, 0] (empty), then a length-1 sequence, then the rest split evenly
    cuts = [0, 0, min(n, 1)]
    rest = max(n - 1, 0)
    k = max(1, min(n_seqs, rest))
    cuts += [1 + (rest * i) // k if n else 0 for i in range(1, k + 1)]
    cu = torch.tensor(cuts, dtype=torch.int64)
    if fully_masked_seq and cu.numel() >= 4:
        mask[int(cu[-2]):int(cu[-1])] = 0  # the last sequence is entirely masked
    return dict(logits=logits, targets=targets, advantages=adv, mask=mask, old_logp=old, ref_logp=ref,
                weights=weights, cu_seqlens=cu)
