"""Adapter-only weight sync for LoRA policies (issue 24): the engine gets the base weights once, at
its start, and every later sync carries the adapter alone (kilobytes to megabytes instead of the
model).

vLLM takes adapters as `LoRARequest`s that name a PEFT folder; the vLLM here (0.32) loads an
adapter from disk only (verl patches a tensor-carrying request into vLLM's worker; we stay on its
public path). So a sync writes the adapter into a private, versioned folder under the engine's
temp directory (inside `<run>/tmp` during a run: `run_tmpdir` points tempfile there) and the next
`generate` names it with a fresh adapter id (`policy-v<n>`, id n): vLLM loads each id once, so a
reused id would silently keep the old adapter — the failure where the adapter never arrives.
Older folders are removed once a newer one was used. `lora.sync: merged` instead sends every
weight with the adapter merged in (engines without LoRA), through the usual bucketed sync.

Departure from TRL (merge, push every weight, unmerge: slow, lossy with QLoRA) and from prime-rl
(filesystem as here, but the whole adapter checkpoint): the folder holds the adapter's tensors
and its config only, written in one call of PEFT's save.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Optional, Tuple

from fastgrpo.models import lora

# vLLM's allowed `max_lora_rank` values (vllm/config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as max_lora_rank that holds `rank`."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank={rank}: vLLM serves adapters up to rank {VLLM_LORA_RANKS[-1]}")


def lora_rank(model) -> int:
    peft = lora.peft_of(model)
    return max(int(c.r) for c in peft.peft_config.values())


class AdapterFolders:
    """Versioned adapter folders under `root` for an engine that loads adapters from disk."""

    def __init__(self, root: str):
        self.root = root
        self.version = 0
        self.path: Optional[str] = None
        self._used: Optional[int] = None  # the newest version a generate has named

    def write(self, model) -> Tuple[int, int, float]:
        """Save `model`'s adapter as the next version; (version, bytes, seconds)."""
        t0 = time.perf_counter()
        self.version += 1
        path = os.path.join(self.root, f"adapter-v{self.version:06d}")
        lora.save_adapter(model, path)
        self.path = path
        nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        return self.version, nbytes, time.perf_counter() - t0

    def request(self):
        """The LoRARequest of the newest version (a fresh id per version); older folders, no
        longer named by any request, are removed."""
        from vllm.lora.request import LoRARequest

        if self.path is None:
            return None
        if self._used != self.version:
            self._used = self.version
            for name in os.listdir(self.root):
                if name.startswith("adapter-v") and os.path.join(self.root, name) != self.path:
                    shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return LoRARequest(f"policy-v{self.version}", self.version, self.path)
