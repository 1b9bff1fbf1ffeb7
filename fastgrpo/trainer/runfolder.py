"""What a run does to its run folder and its process beyond the checkpoints: its temporary
files live inside the folder, and SIGINT / SIGTERM end it with a checkpoint.

- `run_tmpdir(out_dir)`: for the run's lifetime `tempfile` (and TMPDIR, which vLLM's engine
  processes inherit) point at `<out_dir>/tmp`, so model snapshots for the vLLM engine and vLLM's
  own `vllm_dist_*` folders never land in the machine's /tmp. The folder is emptied when the
  run ends and at the next start (what a kill -9 left behind), so nothing outlives the run
  folder even then.
- `graceful_signals(request_stop)`: the first SIGINT / SIGTERM calls `request_stop(signum)`
  (the trainer finishes its step, checkpoints and raises `TrainingInterrupted`); a second one
  interrupts at once (KeyboardInterrupt). Outside the GRPO loop (`request_stop=None`) the first
  signal interrupts at once: SFT, model loading and evaluation are redone on resume.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from typing import Callable, Iterator, Optional

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(Exception):
    """A run ended by SIGINT / SIGTERM after writing its checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint} written" if checkpoint else "no new checkpoint (nothing trained since the last)"
        super().__init__(f"interrupted by {name} after step {step}: {where}; run the same command to resume")

    @property
    def exit_code(self) -> int:
        return 128 + int(self.signum)


@contextlib.contextmanager
def run_tmpdir(out_dir: str) -> Iterator[str]:
    import multiprocessing.util

    # multiprocessing caches its own temp dir (the fork server's socket lives there) on first
    # use and removes it at exit: fix it outside the run folder now, so that removing <run>/tmp
    # never pulls it from under a fork server that outlives this run
    multiprocessing.util.get_temp_dir()
    path = os.path.join(out_dir, "tmp")
    shutil.rmtree(path, ignore_errors=True)  # left by a run that was killed
    os.makedirs(path, exist_ok=True)
    old_dir, old_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = path
    os.environ["TMPDIR"] = path
    try:
        yield path
    finally:
        tempfile.tempdir = old_dir
        if old_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old_env
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def graceful_signals(request_stop: Optional[Callable[[int], None]] = None) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    seen = {"n": 0}

    def handler(signum, frame):
        seen["n"] += 1
        if request_stop is None or seen["n"] > 1:
            for s, h in previous.items():
                signal.signal(s, h)
            raise KeyboardInterrupt(signal.Signals(signum).name)
        request_stop(signum)

    for s in SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
