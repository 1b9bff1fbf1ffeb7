"""Format reward: the completion is a chain of thought in `<think>…</think>` followed by the
answer (DeepSeek-R1's format reward; TRL's `think_format_reward`).

- strict: the whole completion (surrounding whitespace aside) is
  `<think>…</think>` + optional whitespace + `<answer>…</answer>`, each tag exactly once and
  nothing after the answer;
- lenient: one `<think>…</think>` block with an answer after it (the answer tag when
  `answer_tag` is set and present in order, otherwise any non-empty text after `</think>`).
Set `answer_tag=""` for R1-style outputs with a free-form answer after the thought.
Departure from R1: with `require_reasoning=True` (default) an empty think block scores 0, so a
policy cannot collect the format reward by emitting empty tags. Linear-time `str.find` checks,
no regex backtracking on hostile inputs.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from fastgrpo.rewards import reasons as R


def _check(text: str, think: str, answer: str, strict: bool, require_reasoning: bool) -> Optional[str]:
    t_open, t_close = f"<{think}>", f"</{think}>"
    body = text.strip()
    if body.count(t_open) != 1 or body.count(t_close) != 1:
        return R.BAD_FORMAT
    a, b = body.find(t_open), body.find(t_close)
    if b < a or (strict and a != 0):
        return R.BAD_FORMAT
    if require_reasoning and not body[a + len(t_open):b].strip():
        return R.NO_REASONING
    rest = body[b + len(t_close):]
    if not answer:
        return None if rest.strip() else R.BAD_FORMAT
    a_open, a_close = f"<{answer}>", f"</{answer}>"
    if strict:
        rest = rest.strip()
        ok = (rest.startswith(a_open) and rest.endswith(a_close) and rest.count(a_open) == 1
              and rest.count(a_close) == 1 and rest[len(a_open):-len(a_close)].strip() != "")
        return None if ok else R.BAD_FORMAT
    i = rest.find(a_open)
    j = rest.find(a_close, i + len(a_open)) if i >= 0 else -1
    if i >= 0 and j >= 0 and rest[i + len(a_open):j].strip():
        return None
    return R.BAD_FORMAT


def format_reward(completions: Sequence[str], *, strict: bool = True, think_tag: str = "think",
                  answer_tag: str = "answer", require_reasoning: bool = True, return_reasons: bool = False):
    """1.0 for a well-formed `<think>…</think><answer>…</answer>` completion, else 0.0.

    Args:
        completions: model outputs; non-str items score 0 (`bad_input`).
        strict: exact whole-string layout (see module doc) vs lenient.
        think_tag / answer_tag: tag names without brackets; answer_tag="" accepts any answer text.
        require_reasoning: an empty think block scores 0.
        return_reasons: return (scores, reasons).
    """
    if not isinstance(think_tag, str) or not think_tag or "<" in think_tag or ">" in think_tag:
        raise ValueError(f"think_tag={think_tag!r}: expected a bare tag name such as 'think'")
    if not isinstance(answer_tag, str) or "<" in answer_tag or ">" in answer_tag:
        raise ValueError(f"answer_tag={answer_tag!r}: expected a bare tag name such as 'answer', or ''")
    scores: List[float] = []
    why: List[Optional[str]] = []
    for c in completions:
        if isinstance(c, (bytes, bytearray)):
            c = bytes(c).decode("utf-8", "replace")
        reason = _check(c, think_tag, answer_tag, strict, require_reasoning) if isinstance(c, str) else R.BAD_INPUT
        scores.append(0.0 if reason else 1.0)
        why.append(reason)
    return (scores, why) if return_reasons else scores
