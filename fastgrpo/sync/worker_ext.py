"""vLLM worker extension (`worker_extension_cls="fastgrpo.sync.worker_ext.FastGRPOWorkerExtension"`)
receiving bucketed weights from the trainer.

vLLM mixes this class into its worker, so `collective_rpc("fastgrpo_...")` reaches it whether the
worker lives in this process or in the engine-core process. Loading goes through the worker's
in-place `reload_weights(weights_iterator=...)` (checkpoint format): on CPU this is the only
update path after start (vLLM repacks linear weights for oneDNN / SGL kernels when it loads,
and `reload_weights` redoes that packing); on GPU it is the same call.

Departure from a plain reload: vLLM packs a tied lm_head separately from the embedding it
shares a weight with (CPU kernels), and `reload_weights` only re-packs layers that received
weights — so after every sync every other layer sharing that weight gets the fresh packing
(or, where there is no CPU packing to share, its weight processing is re-run).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, List, Sequence, Tuple

import torch

from fastgrpo.sync.bucket import BucketReceiver, TensorSlice, dtype_from_name

# reload_weights warns once per layer that a bucket does not touch ("Failed to load weights")
# and lists every weight outside the bucket: expected with buckets, so silenced while loading.
_NOISY_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")


@contextmanager
def _quiet_reload():
    loggers = [logging.getLogger(n) for n in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _as_tensor(t):
    """A tensor, or (dtype, shape, bytes) sent by value from another process."""
    if isinstance(t, torch.Tensor):
        return t
    dtype, shape, data = t
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype_from_name(dtype)).view(tuple(shape))


class FastGRPOWorkerExtension:
    """Methods mixed into the vLLM worker; every name carries the `fastgrpo_` prefix so it
    cannot collide with the worker's own."""

    def fastgrpo_attach(self, payload: Dict) -> int:
        """Map the trainer's bucket buffers once (shm names, CUDA IPC handles or local tensors)."""
        kind = payload["kind"]
        if kind == "shm":
            from fastgrpo.sync import shm

            self._fastgrpo_buffers, self._fastgrpo_keep = shm.attach(payload)
        elif kind in ("cuda_ipc", "local"):
            from fastgrpo.sync import cuda_ipc

            self._fastgrpo_buffers = cuda_ipc.attach(payload)
            self._fastgrpo_keep = None
        else:
            raise ValueError(f"transport kind={kind!r}: expected 'shm', 'cuda_ipc' or 'local'")
        self._fastgrpo_receiver = BucketReceiver()
        return len(self._fastgrpo_buffers)

    def fastgrpo_load_bucket(self, index: int, bucket: Sequence[TensorSlice]) -> int:
        """Load bucket `index` of the attached buffers; returns the number of tensors loaded.
        Returns only once the buffer may be refilled (device work finished)."""
        buffers = getattr(self, "_fastgrpo_buffers", None)
        if buffers is None:
            raise RuntimeError("fastgrpo_load_bucket before fastgrpo_attach: the trainer must send the buffers first")
        ready = self._fastgrpo_receiver.receive(buffers[index], bucket)
        self._fastgrpo_reload(ready)
        if buffers[index].is_cuda:
            torch.cuda.current_stream(buffers[index].device).synchronize()
        return len(ready)

    def fastgrpo_load_named(self, items: Sequence[Tuple[str, torch.Tensor, str, int]]) -> int:
        """Per-parameter path (one call per tensor, as TRL does): the baseline of bench_sync."""
        if getattr(self, "_fastgrpo_receiver", None) is None:
            self._fastgrpo_receiver = BucketReceiver()
        ready = self._fastgrpo_receiver.receive_named((n, _as_tensor(t), g, k) for n, t, g, k in items)
        self._fastgrpo_reload(ready)
        return len(ready)

    def fastgrpo_finish(self) -> List[str]:
        """End of one sync: re-pack layers sharing a weight; returns names left incomplete."""
        receiver = getattr(self, "_fastgrpo_receiver", None)
        left = receiver.incomplete() if receiver is not None else []
        if receiver is not None:
            receiver.reset()
        self._fastgrpo_reprocess_shared()
        return left

    def fastgrpo_param_names(self) -> List[str]:
        return [n for n, _ in self.model_runner.model.named_parameters()]

    def fastgrpo_set_loading(self, enabled: bool) -> bool:
        """enabled=False: receive and assemble buckets but skip `reload_weights` — bench_sync
        uses it to time the transport apart from the engine's own reload."""
        self._fastgrpo_skip_load = not enabled
        return enabled

    def _fastgrpo_reload(self, named: List[Tuple[str, torch.Tensor]]) -> None:
        if not named or getattr(self, "_fastgrpo_skip_load", False):
            return
        with _quiet_reload():
            self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)

    def _fastgrpo_reprocess_shared(self) -> None:
        model = self.model_runner.model
        owners: Dict[int, list] = {}
        for module in model.modules():
            w = module._parameters.get("weight") if hasattr(module, "_parameters") else None
            if w is not None:
                owners.setdefault(id(w), []).append(module)
        for modules in owners.values():
            # the first owner (e.g. model.embed_tokens, before lm_head in module order) received
            # the weight and was re-packed by reload_weights; the others still hold the old
            # packing. Same weight, same packing: share the fresh one instead of packing again
            # (the tied 32000×768 matrix of bench_sync is a quarter of the model).
            fresh = getattr(modules[0], "cpu_linear", None)
            for module in modules[1:]:
                if not hasattr(module, "cpu_linear"):
                    continue
                if fresh is not None:
                    module.cpu_linear = fresh
                else:
                    module.quant_method.process_weights_after_loading(module)
