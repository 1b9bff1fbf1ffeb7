"""Language-consistency reward (DeepSeek-R1 §2.3.2): the share of the chain of thought written
in the target language, which R1 adds to curb language mixing.

R1 counts target-language words; without a language-ID model this counts by *script*: each
run of Latin / Cyrillic / Greek / Arabic / Hebrew / Devanagari / Thai letters is one word and
each CJK character (Han, kana, Hangul) is one word, and the reward is the share of words in the
target script. Departure: it cannot tell English from French (both Latin); digits, punctuation
and LaTeX commands are ignored rather than counted. Character-class regexes only: linear time.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence

from fastgrpo.rewards import reasons as R

_SCRIPTS: Dict[str, str] = {
    "latin": r"[A-Za-z\u00C0-\u024F]+",
    "cyrillic": r"[\u0400-\u04FF]+",
    "greek": r"[\u0370-\u03FF]+",
    "arabic": r"[\u0600-\u06FF]+",
    "hebrew": r"[\u0590-\u05FF]+",
    "devanagari": r"[\u0900-\u097F]+",
    "thai": r"[\u0E00-\u0E7F]+",
    "cjk": r"[\u4E00-\u9FFF\u3400-\u4DBF\u3040-\u30FF\uAC00-\uD7AF]",
}
_LANG_TO_SCRIPT = {"en": "latin", "fr": "latin", "de": "latin", "es": "latin", "it": "latin", "pt": "latin",
                   "ru": "cyrillic", "uk": "cyrillic", "el": "greek", "ar": "arabic", "he": "hebrew",
                   "hi": "devanagari", "th": "thai", "zh": "cjk", "ja": "cjk", "ko": "cjk"}
_RE = {k: re.compile(v) for k, v in _SCRIPTS.items()}
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")


def _script(language: str) -> str:
    key = language.lower() if isinstance(language, str) else language
    if key in _SCRIPTS:
        return key
    if key in _LANG_TO_SCRIPT:
        return _LANG_TO_SCRIPT[key]
    raise ValueError(f"language={language!r}: expected a script {sorted(_SCRIPTS)} or a language code "
                     f"{sorted(_LANG_TO_SCRIPT)}")


def script_fractions(text: str) -> Dict[str, float]:
    """Share of words per script in `text` (empty dict when it has no letters)."""
    text = _LATEX_CMD.sub(" ", text)
    counts = {k: len(r.findall(text)) for k, r in _RE.items()}
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items() if v} if total else {}


def language_reward(completions: Sequence[str], *, language: str = "en", think_tag: Optional[str] = "think",
                    return_reasons: bool = False):
    """Fraction of the chain of thought (the `<think>` block when present, else the whole
    completion) in the target language's script; 0.0 when there is no text to judge."""
    script = _script(language)
    scores: List[float] = []
    why: List[Optional[str]] = []
    for c in completions:
        if isinstance(c, (bytes, bytearray)):
            c = bytes(c).decode("utf-8", "replace")
        if not isinstance(c, str):
            scores.append(0.0)
            why.append(R.BAD_INPUT)
            continue
        cot = c
        if think_tag:
            a, b = c.find(f"<{think_tag}>"), c.find(f"</{think_tag}>")
            if 0 <= a < b:
                cot = c[a + len(think_tag) + 2:b]
        fr = script_fractions(cot)
        score = fr.get(script, 0.0)
        scores.append(score)
        why.append(None if score > 0 else (R.NO_REASONING if not fr else R.WRONG))
    return (scores, why) if return_reasons else scores
