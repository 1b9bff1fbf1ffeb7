"""Math answer reward: extract the final answer, decide equivalence with Math-Verify, SymPy as a
fallback, every check under a hard timeout in a worker process.

Follows the R1 / DAPO / TRL `accuracy_reward` recipe (binary reward on the final answer checked
by a symbolic verifier; Hugging Face Math-Verify `parse`/`verify`). Departures:
- extraction happens here, in the parent, with linear-time scans of the last part of the text
  (`<answer>…</answer>`, the last `\\boxed{}`, a final "Answer:" line, optionally the last
  number), so a 1 MB completion costs microseconds and only a short answer crosses the pipe;
- Math-Verify's `signal.alarm` timeout is kept as a soft inner limit, but the hard limit is the
  pool's kill-and-replace, because a big-integer power (10**10**10) never yields to a signal;
- the SymPy fallback evaluates only a whitelisted alphabet with a tiny namespace (no builtins,
  no underscores, no strings), because `parse_expr` is `eval` and the input is model output;
- percentages are stripped (50% ≡ 50) unless `percent_as_fraction=True` (then 50% ≡ 0.5 too).
"""
from __future__ import annotations

import re
from typing import Callable, List, Optional, Sequence, Tuple

from fastgrpo.rewards import reasons as R
from fastgrpo.rewards.sandbox.pool import RewardPool, default_pool

_TAIL = 4096  # "Answer:" lines and the last number are looked for in the last 4 KiB only
_BOX = ("\\boxed{", "\\fbox{", "\\boxed {")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
# A number, whitespace, then a word of ≥ 2 letters: "5 cm", "12 apples". Whitespace and the
# second letter keep "2x" or "3 x" (variables) from being cut to a bare number.
_UNIT_RE = re.compile(r"^\s*([-+]?\$?\s*[\d.,]+(?:/\d+)?)\s*(?:\\?%)?\s+[A-Za-z]{2,}[A-Za-z .^\d]*\.?\s*$")
_TEXT_RE = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
_ANSWER_LINE = re.compile(r"answer\s*(?:is\s*[:：]?|[:：])\s*(.+)", re.IGNORECASE)
_SYMPY_OK = re.compile(r"^[0-9a-zA-Z+\-*/^().,= ]*$")
_SYMPY_NAMES = {"sqrt", "pi", "sin", "cos", "tan", "log", "exp", "E", "I"}


def _last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...}, braces matched; None if absent or unbalanced."""
    start = max(text.rfind(b) for b in _BOX)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        c = text[j]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def last_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...} (braces matched), stripped; None if absent, unbalanced or empty."""
    b = _last_boxed(text)
    return (b.strip() or None) if b is not None else None


def answer_line(text: str) -> Optional[str]:
    """The answer of a final "Answer: …" / "the answer is …" line (last 3 non-empty lines of the tail)."""
    lines = [ln for ln in text[-_TAIL:].splitlines() if ln.strip()]
    for line in reversed(lines[-3:]):
        m = _ANSWER_LINE.search(line)
        if m:
            return m.group(1).strip().rstrip(".").strip("$ ")
    return None


def last_number(text: str) -> Optional[str]:
    """The last number of the text's last 4 KiB, thousands commas dropped."""
    nums = _NUMBER_RE.findall(text[-_TAIL:])
    return nums[-1].replace(",", "") if nums else None


def extract_answer(text: str, answer_tag: str = "answer", last_number_fallback: bool = True) -> Optional[str]:
    """The final answer of a completion, or None. Priority: the last <answer>…</answer> (a
    \\boxed{} inside it wins), the last \\boxed{}, a final "Answer: …" line, the last number."""
    if answer_tag:
        open_t, close_t = f"<{answer_tag}>", f"</{answer_tag}>"
        end = text.rfind(close_t)
        if end >= 0:
            start = text.rfind(open_t, 0, end)
            if start >= 0:
                inner = text[start + len(open_t):end]
                return (_last_boxed(inner) or inner).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    line = answer_line(text)
    if line is not None:
        return line
    if last_number_fallback:
        return last_number(text)
    return None


def normalize(ans: str, percent_as_fraction: bool) -> List[str]:
    """Forms of an answer to try, most faithful first: units and \\text{} stripped, `$` and
    trailing periods dropped, percent handled per `percent_as_fraction`."""
    a = ans.strip().strip("$").strip().rstrip(".")
    a = _TEXT_RE.sub(r" \1", a).strip()
    m = _UNIT_RE.match(a)
    if m:  # "5 cm", "12 apples", "$3.50 dollars"
        a = m.group(1).replace("$", "").strip()
    forms = []
    if "%" in a:
        stripped = a.replace("\\%", "").replace("%", "").strip()
        if percent_as_fraction:
            forms.append(a if "\\%" in a else a.replace("%", "\\%"))
        forms.append(stripped)
    else:
        forms.append(a)
    return forms


def _parse(form: str, soft_timeout: int):
    from math_verify import parse

    parsed = parse(f"${form}$", parsing_timeout=soft_timeout)
    if len(parsed) < 2:  # no SymPy object from the LaTeX reading: try the plain-text one
        raw = parse(form, parsing_timeout=soft_timeout)
        parsed = raw if len(raw) >= 2 else (parsed or raw)
    return parsed


def _sympy_equal(a: str, b: str) -> bool:
    """Restricted SymPy fallback: both sides in a whitelisted alphabet, single-letter symbols
    or known function names only, evaluated with no builtins."""
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application, parse_expr,
                                            standard_transformations)

    for s in (a, b):
        if not _SYMPY_OK.match(s) or len(s) > 200:
            return False
        for word in re.findall(r"[A-Za-z]+", s):
            if len(word) > 1 and word not in _SYMPY_NAMES:
                return False
    names = {n: getattr(sympy, n) for n in ("Integer", "Float", "Rational", "Symbol", "sqrt", "pi", "sin", "cos",
                                            "tan", "log", "exp", "E", "I")}
    names["__builtins__"] = {}
    tr = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        ea = parse_expr(a, global_dict=dict(names), transformations=tr)
        eb = parse_expr(b, global_dict=dict(names), transformations=tr)
        return bool(sympy.simplify(ea - eb) == 0)
    except Exception:
        return False


def verify_one(pred: str, gold: str, percent_as_fraction: bool = False, soft_timeout: int = 3
               ) -> Tuple[Optional[float], Optional[str]]:
    """Worker-side check of one extracted answer against one gold answer: (score, reason)."""
    from math_verify import verify

    gold_forms = [_parse(g, soft_timeout) for g in normalize(gold, percent_as_fraction)]
    # a gold answer must read as mathematics: a bare string fallback means it did not parse
    gold_forms = [g for g in gold_forms if len(g) >= 2]
    if not gold_forms:
        return None, R.GOLD_UNPARSABLE
    pred_norm = normalize(pred, percent_as_fraction)
    pred_forms = [p for p in (_parse(x, soft_timeout) for x in pred_norm) if p]
    for g in gold_forms:
        for p in pred_forms:
            if verify(g, p, timeout_seconds=soft_timeout):
                return 1.0, None
    for g in normalize(gold, percent_as_fraction):
        for p in pred_norm:
            if _sympy_equal(g, p):
                return 1.0, None
    # a bare string fallback (no SymPy object) means the prediction did not read as mathematics
    return 0.0, (R.WRONG if any(len(p) >= 2 for p in pred_forms) else R.UNPARSABLE)


def gold_ok(gold: str, percent_as_fraction: bool = False, soft_timeout: int = 3) -> bool:
    """Worker-side: True when a gold answer reads as mathematics (the gold half of `verify_one`)."""
    return any(len(_parse(g, soft_timeout)) >= 2 for g in normalize(gold, percent_as_fraction))


def golds_parse(golds: Sequence[str], *, timeout: float = 5.0, pool: Optional[RewardPool] = None,
                percent_as_fraction: bool = False) -> List[bool]:
    """Whether each gold answer parses as `math_reward` would read it (a load-time check of a
    task's references; each distinct gold once, in the pool, under the hard timeout)."""
    uniq = list(dict.fromkeys(golds))
    if not uniq:
        return []
    soft = max(1, int(timeout) - 1)
    res = (pool or default_pool()).map(gold_ok, [(g, percent_as_fraction, soft) for g in uniq], timeout=timeout)
    ok = {g: bool(r.ok and r.value) for g, r in zip(uniq, res)}
    return [ok[g] for g in golds]


def _gold_text(gold) -> Optional[str]:
    if isinstance(gold, (int, float)):
        return repr(gold)
    if not isinstance(gold, str) or not gold.strip():
        return None
    boxed = _last_boxed(gold)
    return boxed if boxed is not None else gold


def _as_text(c) -> Optional[str]:
    if isinstance(c, str):
        return c
    if isinstance(c, (bytes, bytearray)):
        return bytes(c).decode("utf-8", "replace")
    return None


def math_reward(completions: Sequence[str], answers: Sequence[str], *, timeout: float = 5.0,
                pool: Optional[RewardPool] = None, answer_tag: str = "answer", last_number_fallback: bool = True,
                percent_as_fraction: bool = False, max_answer_chars: Optional[int] = 1000,
                example_ids: Optional[Sequence] = None, return_reasons: bool = False,
                extract: Optional[Callable[[str], Optional[str]]] = None, judge: Optional[Callable] = None):
    """1.0 when the completion's final answer is equivalent to the gold answer, else 0.0; None
    when the gold answer cannot be parsed (a data error, logged once, that the trainer skips).

    Args:
        completions: model outputs (any str; bytes are decoded; other types score 0).
        answers: gold answers, one per completion (str, a number, or LaTeX with \\boxed{}).
        timeout: hard seconds per item, enforced by killing the worker.
        pool: a RewardPool; default: the shared process-wide pool.
        answer_tag: tag whose last occurrence holds the answer ("" to disable).
        last_number_fallback: use the last number of the text when nothing else is found.
        percent_as_fraction: also accept 50% ≡ 0.5 (50% ≡ 50 always holds).
        max_answer_chars: longer extracted answers score 0 (`answer_too_long`) without a worker.
        example_ids: names used in data-error messages (default: the batch index).
        return_reasons: return (scores, reasons) instead of scores.
        extract: the task's own answer extractor `extract(text) -> answer or None`, used instead
            of `extract_answer(text, answer_tag, last_number_fallback)` (fastgrpo.tasks.math).
        judge: `judge(indices, answers, golds) -> [1.0 | 0.0 | None]`, asked only about the items
            whose extracted answer did not parse (reason `unparsable`); a 1.0 makes the item
            correct (reason `judged`), anything else leaves it 0 (fastgrpo.rewards.judge).
    """
    if len(completions) != len(answers):
        raise ValueError(f"answers: expected one per completion ({len(completions)}), got {len(answers)}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r}: expected a positive number of seconds")
    if example_ids is not None and len(example_ids) != len(completions):
        raise ValueError(f"example_ids: expected one per completion ({len(completions)}), got {len(example_ids)}")
    scores: List[Optional[float]] = [0.0] * len(completions)
    why: List[Optional[str]] = [None] * len(completions)
    jobs, where = [], []
    soft = max(1, int(timeout) - 1)
    for i, (c, gold) in enumerate(zip(completions, answers)):
        name = example_ids[i] if example_ids is not None else i
        g = _gold_text(gold)
        if g is None:
            scores[i], why[i] = None, R.GOLD_UNPARSABLE
            R.report_data_error("math gold", repr(gold)[:200], f"example {name}: gold answer {gold!r} is empty or not text")
            continue
        text = _as_text(c)
        if text is None:
            why[i] = R.BAD_INPUT
            continue
        ans = extract(text) if extract is not None else extract_answer(text, answer_tag, last_number_fallback)
        if not ans:
            why[i] = R.NO_ANSWER
        elif max_answer_chars is not None and len(ans) > max_answer_chars:
            why[i] = R.ANSWER_TOO_LONG
        else:
            jobs.append((ans, g, percent_as_fraction, soft))
            where.append((i, name, gold))
    # A group of G samples often repeats one answer: verify each distinct (answer, gold) once.
    uniq = list(dict.fromkeys(jobs))
    done = dict(zip(uniq, (pool or default_pool()).map(verify_one, uniq, timeout=timeout))) if uniq else {}
    for job, (i, name, gold) in zip(jobs, where):
        res = done[job]
        if not res.ok:
            why[i] = res.reason if res.reason in (R.TIMEOUT, R.WORKER_CRASH) else R.UNPARSABLE
            continue
        scores[i], why[i] = res.value
        if why[i] == R.GOLD_UNPARSABLE:
            R.report_data_error("math gold", repr(gold)[:200], f"example {name}: gold answer {gold!r} does not parse")
    asked = [(i, job[0], job[1]) for job, (i, _, _) in zip(jobs, where) if why[i] == R.UNPARSABLE]
    if judge is not None and asked:  # a learned equivalence check where the symbolic one could not read the answer
        for (i, _, _), verdict in zip(asked, judge(*map(list, zip(*asked)))):
            if verdict == 1.0:
                scores[i], why[i] = 1.0, R.JUDGED
    return (scores, why) if return_reasons else scores
