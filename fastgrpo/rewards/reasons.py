"""Reason codes: why a reward scored 0 (or None), so a trainer can log *why* rewards are low
(`reward/math/reason/no_answer: 0.31`) instead of only that they are.

Every reward function takes `return_reasons=False`; with True it returns `(scores, reasons)`,
where `reasons[i]` is None when item i scored above 0 for the normal reason, else one of these.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Dict, Iterable, Optional

logger = logging.getLogger("fastgrpo.rewards")

# math
NO_ANSWER = "no_answer"  # nothing extractable from the completion
ANSWER_TOO_LONG = "answer_too_long"  # extracted answer longer than max_answer_chars
UNPARSABLE = "unparsable"  # the prediction did not parse as mathematics
WRONG = "wrong"  # parsed, not equivalent to the gold answer
GOLD_UNPARSABLE = "gold_unparsable"  # data error: the score is None
JUDGED = "judged"  # unparsable, scored 1 by the accuracy judge (fastgrpo.rewards.judge)
# code
NO_CODE = "no_code"
TESTS_FAILED = "tests_failed"
SOLUTION_ERROR = "solution_error"  # the solution raised before the tests ran
OUTPUT_LIMIT = "output_limit"
CRASHED = "crashed"  # killed by a signal / rlimit (memory, cpu, processes)
TESTS_INVALID = "tests_invalid"  # data error: the hidden tests do not compile; score None
# format / language
BAD_FORMAT = "bad_format"
NO_REASONING = "no_reasoning"
# shared
TIMEOUT = "timeout"  # hard per-item timeout hit; the worker was killed
WORKER_CRASH = "worker_crash"
BAD_INPUT = "bad_input"  # not a str (None, bytes ...): scored 0, never raised


def reason_counts(reasons: Iterable[Optional[str]], prefix: str) -> Dict[str, float]:
    """Fractions of each reason over a batch, as metrics named `<prefix>/reason/<code>`."""
    reasons = list(reasons)
    if not reasons:
        return {}
    counts = Counter(r for r in reasons if r is not None)
    return {f"{prefix}/reason/{k}": v / len(reasons) for k, v in sorted(counts.items())}


_REPORTED: set = set()


def report_data_error(kind: str, key: str, message: str) -> None:
    """Log a data error once per (kind, key): a broken gold answer repeated in every group of
    every epoch must not flood the log, but must not be silent either."""
    if (kind, key) in _REPORTED:
        return
    _REPORTED.add((kind, key))
    logger.warning("data error (%s): %s", kind, message)
