"""The sandbox's file-system view: nothing a run writes outlives it.

Inside the run's private mount namespace (runner.py), `apply_view` (1) remounts every mount of
a real file system read-only (a bind remount: the flag is per mount, so only this namespace's
copies change, never the host's), then (2) mounts a fresh size-capped tmpfs over each
world-writable directory of the view, so programs that expect /tmp, /var/tmp, /dev/shm,
/run/lock ... to be writable still work, privately. The world-writable directories are
enumerated, not listed: `view_plan` walks every real file system breadth-first (once per
pool, four levels below each mount point: a full walk of a large disk takes seconds) and keeps
the directories with the "other" write bit, the only ones a sandbox uid, which owns nothing and
has no groups, can write. A world-writable directory deeper than the walk reached is
still covered by (1): read-only, so a write there fails instead of persisting. Kernel
interfaces (proc, sysfs, cgroup, devpts, ...) are left as they are: what the sandbox uid may
write there is per-process state that does not persist (SysV IPC and POSIX message queues get
a private IPC namespace in runner.py). The same idea as bubblewrap's `--ro-bind / / --tmpfs
/tmp`, derived from the mount table instead of a command line.
"""
from __future__ import annotations

import ctypes
import os
import stat
from collections import deque
from typing import List, Tuple

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND = 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit → mount flag to keep on the read-only remount (clearing nosuid / nodev /
# noexec would loosen the mount; keeping them is also required inside user namespaces)
_KEEP = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
         (getattr(os, "ST_NOATIME", 1024), MS_NOATIME), (getattr(os, "ST_NODIRATIME", 2048), MS_NODIRATIME),
         (getattr(os, "ST_RELATIME", 4096), MS_RELATIME))
# Kernel interfaces, not storage: nothing written there by an unprivileged uid persists.
_PSEUDO = frozenset(("proc", "sysfs", "cgroup", "cgroup2", "devpts", "debugfs", "tracefs",
                     "securityfs", "pstore", "bpf", "configfs", "fusectl", "binfmt_misc", "autofs", "hugetlbfs",
                     "efivarfs", "selinuxfs", "nsfs", "rpc_pipefs"))
# The walk that enumerates world-writable directories: four levels below each mount point (3.4k
# directories, ~60 ms on this machine's root file system; a full walk of its 65k takes 3-13 s)
# and at most 20k directories per file system.
_SCAN_DEPTH, _SCAN_DIRS = 4, 20_000
ALWAYS_PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")  # the standard scratch places, whatever their mode

_PLAN: List[Tuple[List[Tuple[bytes, int]], List[bytes]]] = []


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as \\ooo octal."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_table(path: str = "/proc/self/mountinfo") -> List[Tuple[str, str]]:
    """(mount point, file-system type) of every mount in this process's view, in mount order."""
    out = []
    with open(path) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if len(fields) >= 5 and right:
                out.append((_unescape(fields[4]), right.split()[0]))
    return out


def world_writable_dirs(roots: List[str], max_depth: int = _SCAN_DEPTH, budget: int = _SCAN_DIRS) -> List[str]:
    """Directories under `roots` (each walked breadth-first within its own file system, down to
    `max_depth` levels and at most `budget` directories) that any uid may write: the 'other'
    write bit (sticky or not)."""
    found = []
    for root in roots:
        try:
            dev = os.lstat(root).st_dev
        except OSError:
            continue
        todo, seen = deque([(root, 0)]), 0
        while todo and seen < budget:
            d, depth = todo.popleft()
            seen += 1
            try:
                st = os.lstat(d)
                if st.st_dev != dev or not stat.S_ISDIR(st.st_mode):
                    continue  # another mount (walked as its own root) or a symlink
                if st.st_mode & 0o002:
                    found.append(d)
                    continue  # covered by the tmpfs over it: nothing below is visible then
                if depth < max_depth:
                    with os.scandir(d) as it:
                        todo.extend((e.path, depth + 1) for e in it if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
    return found


def _mount_flags(path: str) -> int:
    f = os.statvfs(path).f_flag
    return MS_REMOUNT | MS_BIND | MS_RDONLY | sum(ms for st, ms in _KEEP if f & st)


def view_plan(refresh: bool = False) -> Tuple[List[Tuple[bytes, int]], List[bytes]]:
    """(read-only remounts as (mount point, flags), private tmpfs targets), computed once per
    process in the trusted worker; the pre-exec hook only issues the mount calls."""
    if _PLAN and not refresh:
        return _PLAN[0]
    real = []
    for point, fstype in mount_table():
        if fstype not in _PSEUDO and os.path.isdir(point):
            try:
                real.append((point, _mount_flags(point)))
            except OSError:
                continue
    points = sorted({p for p, _ in real}, key=lambda p: (p.count("/"), p))
    writable = set(world_writable_dirs(points)) | {p for p in ALWAYS_PRIVATE if os.path.isdir(p)}
    # a directory below another target is hidden by that target's tmpfs: mount the top ones only
    targets = [d for d in sorted(writable, key=lambda p: (p.count("/"), p))
               if not any(d != t and d.startswith(t.rstrip("/") + "/") for t in writable)]
    plan = ([(p.encode(), fl) for p, fl in real], [t.encode() for t in targets])
    _PLAN[:] = [plan]
    return plan


def apply_view(lc, plan, tmpfs_mb: int) -> Tuple[List[bytes], bool]:
    """In a fresh private mount namespace (pre-exec, as root): remount read-only, then mount the
    private tmpfs. Returns the targets that got one and whether every read-only remount held
    (a mount that refuses one, e.g. some FUSE file systems, stays as writable as it was)."""
    remounts, targets = plan
    sealed = True
    for point, flags in remounts:
        assert flags & MS_BIND and flags & MS_REMOUNT  # a remount without MS_BIND would change the host's superblock
        if lc.mount(None, point, None, ctypes.c_ulong(flags), None) != 0:
            sealed = False
    opts = b"size=%dm,mode=1777" % tmpfs_mb
    done = [t for t in targets if lc.mount(b"tmpfs", t, b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), opts) == 0]
    return done, sealed
