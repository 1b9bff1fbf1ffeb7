"""Code reward: run model-written Python against hidden unit tests in the sandbox (sandbox/: the
tests run in a judge process, the solution in another, see sandbox/judge.py), in parallel on the
reward pool.

Follows the RLVR code-reward recipe of DeepSeek-R1 / Kimi K1.5 / DeepCoder (binary reward: all
hidden tests pass), with the fractional variant (share of passing asserts) as an option; the
unit of a "test" is one top-level `assert` of the test source, so a test file needs no harness
of its own. Departure: tests that do not compile are a data error (score None, logged once),
not a 0 the policy is blamed for.
"""
from __future__ import annotations

import logging
import re
import weakref
from typing import List, Optional, Sequence

from fastgrpo.rewards import reasons as R
from fastgrpo.rewards.sandbox.pool import RewardPool, default_pool
from fastgrpo.rewards.sandbox.runner import SandboxLimits, run_python

logger = logging.getLogger("fastgrpo.rewards")
_FENCE_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# The pool's hard limit sits above the sandbox's own wall clock: the sandbox kills and reports
# first; the pool only fires if the worker itself wedges (process start, cleanup).
_POOL_MARGIN_S = 2.0


def extract_code(text: str, think_tag: str = "think") -> Optional[str]:
    """The program in a completion: the last fenced block (```python / ```py / ```) after the
    chain of thought; without a fence, the text after the last </think> (bare code)."""
    if think_tag:
        close = f"</{think_tag}>"
        cut = text.rfind(close)
        if cut >= 0:
            text = text[cut + len(close):]
    blocks = _FENCE_RE.findall(text)
    if blocks:
        return blocks[-1]
    stripped = text.strip()
    return stripped or None


_WARNED_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


def _warn_if_weak(pool: RewardPool) -> None:
    """Say once per pool when the sandbox runs without network isolation or without a uid of
    its own (not root): the policy's code could then reach the network, or signal processes of
    the trainer's user and share its process count."""
    if pool in _WARNED_POOLS:
        return
    _WARNED_POOLS.add(pool)
    level = pool.isolation_level()
    if "netns" not in level:
        logger.warning("code sandbox has NO network isolation (%s): allow user namespaces or run as root", level)
    elif "setuid" not in level:
        logger.warning("code sandbox runs without a uid of its own (%s): run as root for a per-run uid, a "
                       "real process cap and private /tmp", level)
    else:
        logger.info("code sandbox isolation: %s", level)


def _check_tests(src) -> bool:
    if not isinstance(src, str) or not src.strip():
        return False
    try:
        compile(src, "tests.py", "exec")
        return True
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def code_reward(completions: Sequence[str], tests: Sequence[str], timeout: float = 5.0, *,
                pool: Optional[RewardPool] = None, mode: str = "all", limits: Optional[SandboxLimits] = None,
                think_tag: str = "think", example_ids: Optional[Sequence] = None, return_reasons: bool = False):
    """Execute each completion's Python then its hidden tests in the sandbox.

    Args:
        completions: model outputs holding Python (a fenced block or bare code).
        tests: Python source with top-level asserts (setup statements allowed), one per completion.
        timeout: wall-clock seconds per execution; the run is killed and scores 0 beyond it.
        pool: a RewardPool; default: the shared process-wide pool.
        mode: "all" → 1.0 iff every assert passes and nothing else raised; "fraction" → share of
            asserts that pass (1.0/0.0 when the tests have no top-level assert).
        limits: SandboxLimits (memory, processes, output cap ...); cpu seconds follow `timeout`.
        example_ids: names used in data-error messages (default: the batch index).
        return_reasons: return (scores, reasons) instead of scores.
    Returns one float per completion, or None where the tests themselves do not compile.
    """
    if len(completions) != len(tests):
        raise ValueError(f"tests: expected one per completion ({len(completions)}), got {len(tests)}")
    if mode not in ("all", "fraction"):
        raise ValueError(f"mode={mode!r}: expected 'all' or 'fraction'")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r}: expected a positive number of seconds")
    if example_ids is not None and len(example_ids) != len(completions):
        raise ValueError(f"example_ids: expected one per completion ({len(completions)}), got {len(example_ids)}")
    lim = limits or SandboxLimits()
    lim = SandboxLimits(**{**lim.__dict__, "cpu_seconds": max(1, min(lim.cpu_seconds, int(timeout + 1)))})
    scores: List[Optional[float]] = [0.0] * len(completions)
    why: List[Optional[str]] = [None] * len(completions)
    jobs, where = [], []
    valid = {}
    for i, (c, t) in enumerate(zip(completions, tests)):
        key = t if isinstance(t, str) else repr(t)
        if key not in valid:
            valid[key] = _check_tests(t)
        if not valid[key]:
            name = example_ids[i] if example_ids is not None else i
            R.report_data_error("code tests", key[:200], f"example {name}: hidden tests do not compile: {key[:200]!r}")
            scores[i], why[i] = None, R.TESTS_INVALID
            continue
        if isinstance(c, (bytes, bytearray)):
            c = bytes(c).decode("utf-8", "replace")
        if not isinstance(c, str):
            why[i] = R.BAD_INPUT
            continue
        code = extract_code(c, think_tag)
        if code is None:
            why[i] = R.NO_CODE
            continue
        jobs.append((code, t, float(timeout), lim))
        where.append(i)
    # Identical programs against identical tests (common within a group) run once.
    uniq = list(dict.fromkeys(jobs))
    pool = pool or default_pool()
    if uniq:
        _warn_if_weak(pool)
    runs = pool.map(run_python, uniq, timeout=timeout + _POOL_MARGIN_S) if uniq else []
    done = dict(zip(uniq, runs))
    for job, i in zip(jobs, where):
        res = done[job]
        if not res.ok:
            why[i] = res.reason if res.reason in (R.TIMEOUT, R.WORKER_CRASH) else R.CRASHED
            continue
        r = res.value
        if r.reason is not None:
            why[i] = r.reason
        elif mode == "all":
            ok = r.done and r.passed == r.total and r.errors == 0
            scores[i], why[i] = (1.0, None) if ok else (0.0, R.TESTS_FAILED)
        else:
            frac = r.passed / r.total if r.total else float(r.errors == 0)
            scores[i], why[i] = frac, (None if frac > 0 else R.TESTS_FAILED)
    return (scores, why) if return_reasons else scores
