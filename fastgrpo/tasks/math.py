"""Math task: the answer extraction a task chooses, the reference answers checked at load, and
accuracy by Math-Verify equivalence (`fastgrpo.rewards.math.math_reward`, in its process pool
with hard timeouts; the extractor below replaces its default one).

`answer_format` (data.answer_format):
- `tags`: the last `<tag>…</tag>` (tag = data.answer_tag; a `\\boxed{}` inside it wins), as R1;
- `boxed`: the last `\\boxed{…}` (braces matched), as MATH / DAPO;
- `gsm8k`: the number after the last `####` (GSM8K's reference form "reasoning #### 42"; the rest of
  the line when it does not start with a number);
- `last_number`: the last number of the text's last 4 KiB (thousands commas dropped);
- `regex:<pattern>`: group 1 of the pattern's last match;
- `auto`: tags, then boxed, then `####`, then an "Answer: …" / "the answer is …" line, then the
  last number (the "answer is" step is ours: it reads `\\frac{1}{2}` where the last number would
  read 2).

A reference answer is read with the same extractor when it holds a full solution; a bare answer
("42", "\\frac{1}{2}", "x^2 + 1": one short line without running words) is taken whole. A reference
that yields nothing, or that Math-Verify cannot read as mathematics, is a load-time error naming
its row (plain numbers skip the parse: GSM8K's 7473 references cost nothing).
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence

from fastgrpo.rewards.math import answer_line, golds_parse, last_boxed, last_number, math_reward
from fastgrpo.tasks.base import Problem, Task

_LEADING_NUMBER = re.compile(r"\$?\s*(-?\d[\d,]*(?:\.\d+)?)(?![\d/^.])")
_PLAIN_NUMBER = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?$")
_WORDS = re.compile(r"[A-Za-z]{2,}[ \t]+[A-Za-z]{2,}")  # two running words: prose, not a bare answer
_LATEX_CMD = re.compile(r"\\[A-Za-z]+(\{[^{}]*\})?")
_BARE_MAX = 100  # a bare reference answer is one line of at most this many characters
FORMATS = ("auto", "tags", "boxed", "gsm8k", "last_number")


def _tags(text: str, tag: str) -> Optional[str]:
    open_t, close_t = f"<{tag}>", f"</{tag}>"
    end = text.rfind(close_t)
    if end < 0:
        return None
    start = text.rfind(open_t, 0, end)
    if start < 0:
        return None
    inner = text[start + len(open_t):end]
    return last_boxed(inner) or inner.strip() or None


def _gsm8k(text: str) -> Optional[str]:
    cut = text.rfind("####")
    if cut < 0:
        return None
    line = text[cut + 4:].strip().split("\n", 1)[0].strip()
    m = _LEADING_NUMBER.match(line)  # "#### 72 clips" → 72, as lm-eval's gsm8k filter reads it
    if m:
        return m.group(1).replace(",", "")
    return line.strip("$").strip() or None


def _answer_line(text: str) -> Optional[str]:
    return answer_line(text) or None


def make_extractor(answer_format: str = "auto", answer_tag: str = "answer") -> Callable[[str], Optional[str]]:
    """`extract(text) -> answer or None` for an answer_format (see the module docstring)."""
    if answer_format.startswith("regex:"):
        try:
            pat = re.compile(answer_format[len("regex:"):])
        except re.error as e:
            raise ValueError(f"data.answer_format={answer_format!r}: not a valid regular expression ({e})") from None
        if pat.groups < 1:
            raise ValueError(f"data.answer_format={answer_format!r}: the pattern needs a capture group "
                             f"(group 1 is the answer)")

        def regex(text: str) -> Optional[str]:
            last = None
            for last in pat.finditer(text):
                pass
            return (last.group(1) or "").strip() or None if last is not None else None

        return regex
    if answer_format not in FORMATS:
        raise ValueError(f"data.answer_format={answer_format!r}: expected one of {', '.join(FORMATS)}, regex:<pattern>")
    if answer_format in ("tags", "auto") and not (isinstance(answer_tag, str) and re.fullmatch(r"[\w.-]+", answer_tag)):
        raise ValueError(f"data.answer_tag={answer_tag!r}: expected a tag name such as 'answer'")
    if answer_format == "tags":
        return lambda text: _tags(text, answer_tag)
    if answer_format == "boxed":
        return last_boxed
    if answer_format == "gsm8k":
        return _gsm8k
    if answer_format == "last_number":
        return last_number

    def auto(text: str) -> Optional[str]:
        for step in (lambda t: _tags(t, answer_tag), last_boxed, _gsm8k, _answer_line, last_number):
            got = step(text)
            if got:
                return got
        return None

    return auto


def is_bare_answer(ref: str) -> bool:
    """One short line without running words: the answer itself, not a solution."""
    s = ref.strip()
    return bool(s) and "\n" not in s and len(s) <= _BARE_MAX and not _WORDS.search(_LATEX_CMD.sub(" ", s))


def reference_answer(ref, answer_format: str, answer_tag: str, where: str, column: str = "answer") -> str:
    """The gold answer of a row's reference: the format's marker (auto: tags, boxed, ####) when
    present, else the reference whole when it is a bare answer, else (auto, last_number) what the
    full extractor reads; ValueError naming the row when nothing is left."""
    if isinstance(ref, bool) or ref is None:
        raise ValueError(f"{where}: column {column!r} is {ref!r}; expected the reference answer")
    if isinstance(ref, (int, float)):
        return repr(ref) if isinstance(ref, float) else str(ref)
    if not isinstance(ref, str):
        raise ValueError(f"{where}: column {column!r} holds {type(ref).__name__}; expected the reference answer text")
    if not ref.strip():
        raise ValueError(f"{where}: column {column!r} is empty; expected the reference answer")
    if answer_format == "auto":
        got = _tags(ref, answer_tag) or last_boxed(ref) or _gsm8k(ref)
    elif answer_format == "last_number":
        got = None
    else:
        got = make_extractor(answer_format, answer_tag)(ref)
    if not got and is_bare_answer(ref):
        got = ref.strip()
    if not got and answer_format in ("auto", "last_number"):
        got = make_extractor(answer_format, answer_tag)(ref)
    if not got:
        raise ValueError(f"{where}: column {column!r}: the reference {ref[:120]!r} holds no answer that "
                         f"answer_format={answer_format} extracts, and is not a bare answer")
    return got


def check_references(problems: Sequence[Problem], where: Dict[int, str], pool=None, column: str = "answer") -> None:
    """Math-Verify must read every gold answer (plain numbers need no check)."""
    todo = [p for p in problems if not _PLAIN_NUMBER.match(p.answer.replace(",", ""))]
    if not todo:
        return
    ok = golds_parse([p.answer for p in todo], pool=pool)
    for p, good in zip(todo, ok):
        if not good:
            raise ValueError(f"{where[p.id]}: column {column!r}: the reference answer {p.answer[:120]!r} does not "
                             f"parse as mathematics (Math-Verify)")


class MathTask(Task):
    """Problems with a reference answer; accuracy = Math-Verify equivalence of the extracted answer."""

    name = "math"

    def __init__(self, train: List[Problem], heldout: List[Problem], answer_format: str = "auto",
                 answer_tag: str = "answer", **kw):
        super().__init__(train, heldout, **kw)
        self.answer_format = answer_format
        self.answer_tag = answer_tag
        self.extract = make_extractor(answer_format, answer_tag)
        self.format_tags = (answer_tag,) if answer_format == "tags" else None

    def reward_fns(self, pool=None) -> Dict[str, Callable]:
        extract = self.extract

        def accuracy(completions: Sequence[str], answers: Sequence[str]) -> List[Optional[float]]:
            """1.0 when the extracted answer is Math-Verify equivalent to the reference, else 0.0."""
            return math_reward(completions, answers, pool=pool, extract=extract)

        return {"accuracy": accuracy}


class JsonlTask(MathTask):
    """`data.task=jsonl`, the older name of a math task: the same rows and accuracy, plus the
    strict R1 `format` reward of `fastgrpo.rewards.format`, which older configs list."""

    name = "jsonl"

    def reward_fns(self, pool=None) -> Dict[str, Callable]:
        from fastgrpo.rewards.format import format_reward

        return {**super().reward_fns(pool), "format": lambda c, a: format_reward(c)}
