"""CUDA IPC transport for bucketed weight sync (verl / slime style).

Two CUDA byte buffers form the double buffer. Their IPC handles (torch's multiprocessing
reductions, `reduce_tensor`) are sent to the engine once; the engine's worker extension rebuilds
them (`attach`) into tensors over the same device memory and, per bucket, slices views out of
them and loads those. Nothing is serialised per bucket but the small metadata list.

Devices: an IPC handle opens memory of the GPU it was made on, and the rebuild call takes that
GPU's ordinal in the *opening* process. The payload names the buffers' GPU by UUID, and each
engine worker (one per tensor-parallel rank, each on its own GPU) opens them on the ordinal that
UUID has in its own process, then loads its shard from there (a peer read when its GPU is
another). Passing the worker's current device instead, as before, mapped the handle onto the
wrong GPU for every worker not on the trainer's.

Departure: an engine running in this very process (vLLM with VLLM_ENABLE_V1_MULTIPROCESSING=0)
cannot open an IPC handle of its own process (CUDA refuses), so the payload then carries the
tensors themselves ("local"); the data path is the same views of the same buffers.
"""
from __future__ import annotations

import os
import pickle
from typing import Dict, List

import torch

# index of the device ordinal in the argument tuple of torch's rebuild_cuda_tensor
_DEVICE_ARG = 6


class CudaIpcTransport:
    kind = "cuda_ipc"

    def __init__(self, device=None, n_buffers: int = 2, in_process: bool = False):
        if n_buffers not in (1, 2):
            raise ValueError(f"n_buffers={n_buffers!r}: expected 1 or 2")
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda":
            raise ValueError(f"device={device!r}: the CUDA IPC transport needs a CUDA device")
        self.n_buffers = n_buffers
        self.in_process = in_process
        self.nbytes = 0
        self.buffers: List[torch.Tensor] = []

    def ensure(self, nbytes: int) -> bool:
        if nbytes <= self.nbytes and self.buffers:
            return False
        self.buffers = [torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
                        for _ in range(self.n_buffers)]
        self.nbytes = nbytes
        return True

    def payload(self) -> Dict:
        if self.in_process:
            return {"kind": "local", "buffers": self.buffers, "nbytes": self.nbytes, "pid": os.getpid()}
        from torch.multiprocessing.reductions import reduce_tensor

        # pickled here: vLLM's RPC between processes is msgpack and will not carry the rebuild
        # function; the bytes go only from this trainer to its own engine
        return {"kind": self.kind, "handles": [pickle.dumps(reduce_tensor(b)) for b in self.buffers],
                "nbytes": self.nbytes, "pid": os.getpid(), "device_uuid": device_uuid(self.device.index or 0)}

    def close(self) -> None:
        self.buffers = []
        self.nbytes = 0


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def owner_ordinal(uuid: str, visible_uuids: List[str]) -> int:
    """The ordinal, among this process's visible GPUs, of the GPU with `uuid`."""
    if uuid in visible_uuids:
        return visible_uuids.index(uuid)
    raise ValueError(f"device_uuid={uuid}: the trainer's bucket buffers live on a GPU this engine worker cannot "
                     f"see (visible: {visible_uuids}); give the engine's CUDA_VISIBLE_DEVICES the trainer's GPU too")


def attach(payload: Dict, device_index: int = None) -> List[torch.Tensor]:
    """Engine side: rebuild the buffers from their IPC handles on the ordinal of the GPU that
    holds them (`device_uuid` of the payload, resolved in this process; `device_index` overrides)."""
    if payload["kind"] == "local":
        return list(payload["buffers"])
    if device_index is None:
        uuid = payload.get("device_uuid")
        if uuid is None:
            device_index = torch.cuda.current_device()
        else:
            device_index = owner_ordinal(uuid, [device_uuid(i) for i in range(torch.cuda.device_count())])
    buffers = []
    for blob in payload["handles"]:
        rebuild, args = pickle.loads(blob) if isinstance(blob, (bytes, bytearray)) else blob
        args = list(args)
        args[_DEVICE_ARG] = device_index
        buffers.append(rebuild(*args))
    return buffers
