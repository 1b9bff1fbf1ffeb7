"""CPU shared-memory transport for bucketed weight sync.

Two POSIX shared-memory segments (`multiprocessing.shared_memory`) serve as the double buffer:
the trainer packs bucket k+1 into one while the engine loads bucket k from the other. The
engine attaches to them by name once (`attach`), so the same code serves an engine in this
process or in vLLM's engine-core process. The engine loads the views with its worker's
`reload_weights(weights_iterator=...)` (see worker_ext.py).
"""
from __future__ import annotations

import errno
import os
from multiprocessing import shared_memory
from typing import Dict, List

import torch


class ShmTransport:
    kind = "shm"

    def __init__(self, n_buffers: int = 2):
        if n_buffers not in (1, 2):
            raise ValueError(f"n_buffers={n_buffers!r}: expected 1 or 2")
        self.n_buffers = n_buffers
        self.nbytes = 0
        self._shms: List[shared_memory.SharedMemory] = []
        self.buffers: List[torch.Tensor] = []

    def ensure(self, nbytes: int) -> bool:
        """Allocate buffers of at least `nbytes`; True when (re)allocated (the engine must attach).
        The pages are reserved at once (`posix_fallocate`): a /dev/shm too small to hold them
        raises OSError here, naming the sizes, instead of a SIGBUS at the first write past its end."""
        if nbytes <= self.nbytes and self.buffers:
            return False
        self.close()
        free = shm_free_bytes()
        if free is not None and free < nbytes * self.n_buffers:
            raise OSError(f"shared memory: {self.n_buffers} × {nbytes / 2**20:.0f} MiB needed, {SHM_DIR} has "
                          f"{free / 2**20:.0f} MiB free")
        for _ in range(self.n_buffers):
            shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self._shms.append(shm)
            fd = getattr(shm, "_fd", -1)
            if fd >= 0 and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, max(nbytes, 1))
                except OSError as e:
                    # a filesystem that cannot reserve: the free-space check above stands alone
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        self.close()
                        raise OSError(f"shared memory: reserving {nbytes / 2**20:.0f} MiB in {SHM_DIR} failed: "
                                      f"{e.strerror or e}") from None
            self.buffers.append(torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes))
        self.nbytes = nbytes
        return True

    def payload(self) -> Dict:
        return {"kind": self.kind, "names": [s.name for s in self._shms], "nbytes": self.nbytes, "pid": os.getpid()}

    def close(self) -> None:
        self.buffers = []
        for shm in self._shms:
            try:
                shm.close()
            except BufferError:  # a view is still alive (e.g. the engine in this process): the mapping goes with it
                pass
            try:  # the name goes now either way (a mapping stays valid): a name is only freed by unlink
                shm.unlink()
            except FileNotFoundError:
                pass
        self._shms = []
        self.nbytes = 0


SHM_DIR = "/dev/shm"


def shm_free_bytes():
    """Free bytes of the shared-memory filesystem, None where there is none to ask."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def attach(payload: Dict, track: bool = True):
    """Engine side: map the segments named in `payload`; returns (buffers, handles to keep).
    `track=False` for a process that is not the creator's child (a Ray actor): it has a resource
    tracker of its own, which would unlink the creator's segment when this process exits."""
    shms, buffers = [], []
    for name in payload["names"]:
        # Python < 3.13 registers the segment with this process's resource tracker again; a
        # spawned child shares its parent's tracker, where the name is already registered, so no
        # unregister here (it would make the creator's unlink fail in the tracker).
        shm = shared_memory.SharedMemory(name=name)
        if not track:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(shm._name, "shared_memory")
        shms.append(shm)
        buffers.append(torch.frombuffer(shm.buf, dtype=torch.uint8, count=payload["nbytes"]))
    return buffers, shms
