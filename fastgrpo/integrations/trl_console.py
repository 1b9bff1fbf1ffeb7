"""What the TRL drop-in (fastgrpo.integrations.trl) prints, kept to one copy of each line.

- TRL's vLLM version notice ("TRL currently supports vLLM versions from … to …") is a
  warnings.warn inside `trl.import_utils.is_vllm_available`, which TRL's generation modules call
  at import and again per generation call, each from its own line. Python's filters dedupe per
  line, or per module (CPython's "once" keys on the calling module's registry), so a run showed
  it five times. `quiet_vllm_notice` wraps the function so that the notice shows on its first
  call only; it must run before TRL's trainer modules are imported, since they bind the name
  (`from ..import_utils import is_vllm_available`).
- The loss-path summary (how many micro-batches ran fastgrpo's loss, which fell back and why)
  must be visible at the default log level, which drops INFO records: a warning when some
  micro-batches fell back to TRL's loss (something to act on), else one line on stderr from the
  main process.
"""
from __future__ import annotations

import functools
import logging
import sys
import warnings

VLLM_NOTICE = r"TRL currently supports vLLM versions"  # the start of TRL's notice (a regex)


def vllm_notice_once(fn):
    """`fn` (TRL's `is_vllm_available`) whose version notice shows on the first call only."""
    if getattr(fn, "_fastgrpo_once", False):
        return fn
    calls = []

    @functools.wraps(fn)
    def is_vllm_available(*args, **kwargs):
        if not calls:
            calls.append(1)
            return fn(*args, **kwargs)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=VLLM_NOTICE)
            return fn(*args, **kwargs)

    is_vllm_available._fastgrpo_once = True
    return is_vllm_available


def quiet_vllm_notice() -> None:
    """Wrap `trl.import_utils.is_vllm_available` with `vllm_notice_once` (idempotent)."""
    import trl.import_utils as trl_imports

    trl_imports.is_vllm_available = vllm_notice_once(trl_imports.is_vllm_available)


def report_loss_paths(trainer, log: logging.Logger) -> None:
    """The loss-path summary of `trainer.fastgrpo_stats` when `train()` returns (see the module doc)."""
    stats = trainer.fastgrpo_stats
    if stats.fallback:
        log.warning("%s", stats.summary())
    elif getattr(getattr(trainer, "accelerator", None), "is_main_process", True):
        print(stats.summary(), file=sys.stderr, flush=True)
