"""CPU shared-memory transport for bucketed weight sync.

Two POSIX shared-memory segments (`multiprocessing.shared_memory`) serve as the double buffer:
the trainer packs bucket k+1 into one while the engine loads bucket k from the other. The
engine attaches to them by name once (`attach`), so the same code serves an engine in this
process or in vLLM's engine-core process. The engine loads the views with its worker's
`reload_weights(weights_iterator=...)` (see worker_ext.py).

Nothing outlives the processes that map a segment (issue 34: every kill -9 of an async run's
trainer left each vLLM worker's two buffers, the size of the weights, in /dev/shm). A POSIX name
stays until someone unlinks it, and Python's answer — the creator's `resource_tracker` process
unlinks what it registered when the creator dies — fails where the tracker dies with it: Ray
kills a worker together with its process group, tracker included. So:

- a segment's name goes as soon as every reader has mapped it (`ShmTransport.unlink`; the
  sender calls it once the engine attached): a mapping stays valid after unlink, and the memory
  is the kernel's to free when the last process that maps it ends, however it ends;
- until then the name says who made it (`fastgrpo_<pid namespace>_<pid>_<start time>_<random>`),
  so `sweep` — run before each new segment (a run's first sync: at its start and at a resume)
  and callable by a run at start — removes every fastgrpo segment whose creator process is gone.
  A segment of a live process (another run on this machine) is never touched.
"""
from __future__ import annotations

import errno
import os
import secrets
import sys
from multiprocessing import shared_memory
from typing import Dict, List, Optional

import torch


class ShmTransport:
    kind = "shm"

    def __init__(self, n_buffers: int = 2):
        if n_buffers not in (1, 2):
            raise ValueError(f"n_buffers={n_buffers!r}: expected 1 or 2")
        self.n_buffers = n_buffers
        self.nbytes = 0
        self._shms: List[shared_memory.SharedMemory] = []
        self._named = False  # the segments still have their names in /dev/shm (until `unlink`)
        self.buffers: List[torch.Tensor] = []

    def ensure(self, nbytes: int) -> bool:
        """Allocate buffers of at least `nbytes`; True when (re)allocated (the engine must attach).
        The pages are reserved at once (`posix_fallocate`): a /dev/shm too small to hold them
        raises OSError here, naming the sizes, instead of a SIGBUS at the first write past its end."""
        if nbytes <= self.nbytes and self.buffers:
            return False
        self.close()
        sweep()  # leftovers of dead processes first: their pages count against the space below
        free = shm_free_bytes()
        if free is not None and free < nbytes * self.n_buffers:
            raise OSError(f"shared memory: {self.n_buffers} × {nbytes / 2**20:.0f} MiB needed, {SHM_DIR} has "
                          f"{free / 2**20:.0f} MiB free")
        self._named = True
        for _ in range(self.n_buffers):
            shm = shared_memory.SharedMemory(name=segment_name(), create=True, size=max(nbytes, 1))
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

    def unlink(self) -> None:
        """Every reader has mapped the segments: remove their names (the mappings stay valid, in
        this process and in every reader). From here no process death can leave them behind. A
        reader that comes later needs new segments: `close`, then `ensure`."""
        if self._named:
            for shm in self._shms:
                try:
                    shm.unlink()  # also drops the name from this process's resource tracker
                except FileNotFoundError:
                    pass
            self._named = False

    def close(self) -> None:
        self.buffers = []
        for shm in self._shms:
            try:
                shm.close()
            except BufferError:  # a view is still alive (e.g. the engine in this process): the mapping goes with it
                pass
        self.unlink()  # the names go now either way (a mapping stays valid): a name is only freed by unlink
        self._shms = []
        self.nbytes = 0


SHM_DIR = "/dev/shm"
PREFIX = "fastgrpo_"


def _pid_namespace() -> Optional[str]:
    """The inode of this process's pid namespace (pids mean something only inside it), None
    where there is no /proc to ask (then segments get Python's random names and no sweep)."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]")
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid,
    it names one process for good (a pid alone is reused); None when no such process runs."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def segment_name() -> Optional[str]:
    """`fastgrpo_<pid namespace>_<pid>_<start time>_<random>`: what `sweep` reads to tell a
    leftover from a live process's segment (None off Linux: Python picks a random name)."""
    ns, pid = _pid_namespace(), os.getpid()
    start = _start_time(pid)
    if not sys.platform.startswith("linux") or ns is None or start is None:
        return None
    return f"{PREFIX}{ns}_{pid}_{start}_{secrets.token_hex(4)}"


def sweep(shm_dir: str = SHM_DIR) -> List[str]:
    """Unlink every fastgrpo segment of this pid namespace whose creator process is gone (a
    process that died before the segment's readers had mapped it, e.g. a run killed with
    kill -9). Returns the names removed. Segments of live processes, of other pid namespaces
    and of anyone else stay."""
    ns = _pid_namespace()
    if ns is None:
        return []
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in entries:
        parts = name[len(PREFIX):].split("_") if name.startswith(PREFIX) else []
        if len(parts) != 4 or parts[0] != ns or not parts[1].isdigit():
            continue
        if _start_time(int(parts[1])) == parts[2]:
            continue  # its creator still runs
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):  # gone meanwhile, or another user's
            pass
    return removed


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
