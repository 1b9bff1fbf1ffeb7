"""What the model wrote: a bounded selection of each step's rollouts in `<run>/samples.jsonl`, and
the held-out completions of each evaluation in `<run>/eval_samples.jsonl`.

Follows the rollout dumps of verl (`trainer.rollout_data_dir`: one JSONL per step with input,
output and score) and TRL's `log_completions` (a table of prompt, completion and each reward).
Where we depart: verl dumps every rollout of a step and TRL the whole batch; here a step keeps
at most `logging.samples_max` rows — the best and the worst completion (by the weighted total
reward) of the first groups with a signal (σ > 0), and one row for each of a few groups without
one (σ = 0, the groups that taught nothing: `zero_std: true`, `pick: "no_signal"`) — so a 10 000-
step run with the defaults (every 10 steps, 8 rows of ~1 KB) writes ~8 MB, not the 2.5 GB that a
full dump of 32 prompts × G 8 of 1 KB completions per step would. Under several ranks the rows
are rank 0's shard of the batch (no gather: the selection is a glance, not a record).

A row: step, prompt_id (and `key`, the user's row name, when the task has one), group and index
of the completion in its group, pick (best | worst | no_signal), zero_std, prompt and completion
text, `rewards` (each reward function's unweighted score), `reward` (the weighted total),
advantage, length (completion tokens), finish_reason (stop | length) and, when the rollout
carries one (async workers), the policy version that sampled it.

Writing is atomic per step: the step's rows are one write of whole lines, flushed and fsynced. A
resumed run drops the rows of the steps it redoes: the first time the file is opened in a
process it is rewritten (temp file, fsync, rename) without the rows of steps ≥ the first step
about to run — and without a torn last line, the fragment a kill mid-write leaves (metrics.jsonl
keeps and terminates its fragment instead; here the rewrite is free). A file that cannot be
written ends in one warning line and the run goes on without samples.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from fastgrpo.logs.jsonl import json_value, read_metrics, rewrite_lines


class EvalResult(dict):
    """A held-out evaluation's metrics — a plain dict to every caller — with the completions they
    were computed from in `samples` (the rows of eval_samples.jsonl, written by MetricsLogger.log)."""

    def __init__(self, metrics: Dict[str, float], samples: Sequence[dict] = ()):
        super().__init__(metrics)
        self.samples = list(samples)


def _version(c):
    """The policy version that sampled completion `c` (`Completion.policy_version`, set by the
    async rollout workers; None in colocated runs); a completion whose tokens span several
    versions (`token_versions`: weights updated mid-generation) gives [oldest, newest]."""
    per_token = getattr(c, "token_versions", None)
    if per_token is not None and len(per_token):
        lo, hi = int(min(per_token)), int(max(per_token))
        return lo if lo == hi else [lo, hi]
    return json_value(getattr(c, "policy_version", None))


def _row(step, p, i, j, c, pick, per_fn, total, adv, zero_std) -> dict:
    row = {"step": int(step), "prompt_id": json_value(getattr(p, "id", i))}
    if getattr(p, "key", ""):
        row["key"] = p.key
    row.update(group=i, index=j, pick=pick, zero_std=bool(zero_std[i]), prompt=p.prompt, completion=c.text,
               rewards={name: json_value(float(r[i, j])) for name, r in per_fn.items()},
               reward=json_value(float(total[i, j])), advantage=json_value(float(adv[i, j])),
               length=len(c.token_ids), finish_reason=c.finish_reason)
    version = _version(c)
    if version is not None:
        row["policy_version"] = version
    return _with_episode(row, c)


def _with_episode(row: dict, c) -> dict:
    episode = getattr(c, "episode", None)
    if episode is not None:  # a multi-turn episode, turn by turn: what the model wrote vs what came back
        row.update(stop=episode.stop, turns=episode.turns, tool_calls=episode.tool_calls,
                   episode=episode.transcript())
    return row


def select_samples(step: int, problems: Sequence, groups: Sequence, per_fn: Dict[str, object], total, adv,
                   zero_std, max_rows: int) -> List[dict]:
    """At most `max_rows` rows of one step: one row each for up to a quarter of the budget of
    σ = 0 groups (all of it when no group has a signal), the rest the best and worst completion of
    the first groups with a signal (an odd budget ends with a best alone). In group order."""
    total, adv, zero_std = np.asarray(total, dtype=np.float64), np.asarray(adv, dtype=np.float64), np.asarray(zero_std)
    per_fn = {k: np.asarray(v, dtype=np.float64) for k, v in per_fn.items()}
    signal = [i for i in range(len(groups)) if not zero_std[i] and len(groups[i])]
    flat = [i for i in range(len(groups)) if zero_std[i] and len(groups[i])]
    n_flat = min(len(flat), (max(1, max_rows // 4) if max_rows >= 2 else 0) if signal else max_rows)
    picks = [(i, 0, "no_signal") for i in flat[:n_flat]]
    budget = max_rows - n_flat
    for i in signal[: (budget + 1) // 2]:
        picks.append((i, int(np.argmax(total[i])), "best"))
        if len(picks) - n_flat < budget:
            picks.append((i, int(np.argmin(total[i])), "worst"))
    picks.sort(key=lambda t: t[0])
    return [_row(step, problems[i], i, j, groups[i][j], pick, per_fn, total, adv, zero_std) for i, j, pick in picks]


def eval_rows(problems: Sequence, groups: Sequence, scores) -> List[dict]:
    """Every held-out completion with its verifier score (`scores` [problems, n]), a multi-turn
    episode turn by turn; the step and tag are added when written."""
    scores = np.asarray(scores, dtype=np.float64)
    rows = []
    for i, (p, grp) in enumerate(zip(problems, groups)):
        for j, c in enumerate(grp):
            rows.append(_with_episode({"prompt_id": json_value(getattr(p, "id", i)), "sample": j, "prompt": p.prompt,
                                       "completion": c.text, "score": json_value(float(scores[i, j])),
                                       "length": len(c.token_ids), "finish_reason": getattr(c, "finish_reason", "stop")},
                                      c))
    return rows


def flat_columns(rows: Sequence[dict]):
    """(columns, data) of a table: `rewards` spread into `reward/<name>` columns; prompt and
    completion last (the wide ones)."""
    cols: List[str] = []
    for r in rows:
        for k, v in r.items():
            keys = [f"reward/{n}" for n in v] if k == "rewards" else [k]
            cols += [c for c in keys if c not in cols]
    cols = [c for c in cols if c not in ("prompt", "completion")] + [c for c in ("prompt", "completion") if c in cols]

    def cell(r, c):
        v = r.get("rewards", {}).get(c[len("reward/"):]) if c.startswith("reward/") and c not in r else r.get(c)
        return json.dumps(v) if isinstance(v, (list, dict)) else v

    return cols, [[cell(r, c) for c in cols] for r in rows]


def markdown_table(rows: Sequence[dict], max_chars: int = 400) -> str:
    """Rows as a Markdown table (TensorBoard's text tab renders it); long texts keep their last
    `max_chars` characters (the end of a prompt and of a completion are what differ)."""
    cols, data = flat_columns(rows)

    def fmt(v):
        s = f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
        s = s if len(s) <= max_chars else "…" + s[-max_chars:]
        return s.replace("|", "\\|").replace("\r", "").replace("\n", "↵ ")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


class SamplesFile:
    """A JSONL file of sample rows, opened lazily: the first `open(from_step)` of a process drops
    the rows of steps ≥ from_step and a torn last line (rewrite: temp file, fsync, rename); each
    `write` is one write of whole lines, flushed and fsynced. Any OSError: one warning line through
    `log`, and the file is left alone for the rest of the run."""

    def __init__(self, path: str, log: Callable[[str], None] = print):
        self.path = path
        self.log = log
        self._f = None
        self.failed = False

    def open(self, from_step: int) -> bool:
        if self._f is not None or self.failed:
            return self._f is not None
        try:
            self._drop_from(from_step)
            self._f = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            self._fail(e)
        return self._f is not None

    def _drop_from(self, from_step: int) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        kept, changed = [], not data.endswith(b"\n") and bool(data)
        for line in data.splitlines(keepends=True):
            try:
                row = json.loads(line)
                whole = line.endswith(b"\n") and isinstance(row, dict) and int(row["step"]) < from_step
            except (ValueError, KeyError, TypeError):
                whole = False
            if whole:
                kept.append(line)
            else:
                changed = True
        if not changed:
            return
        rewrite_lines(self.path, kept)

    def write(self, rows: Sequence[dict], step: Optional[int] = None) -> None:
        """Append `rows` (each with a step); opens the file first (from the rows' step) if needed."""
        if not rows or not self.open(step if step is not None else int(rows[0]["step"])):
            return
        try:
            self._f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            self._fail(e)

    def _fail(self, e: OSError) -> None:
        self.failed = True
        self.close()
        self.log(f"[fastgrpo] warning: cannot write {self.path} ({type(e).__name__}: {e}); the run goes on without "
                 "it (metrics.jsonl stays the record; free the disk or fix the folder's permissions to get samples)")

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
            self._f = None


def read_samples(path: str) -> List[dict]:
    """Rows of a samples.jsonl / eval_samples.jsonl (a torn or foreign line is skipped, as in
    metrics.jsonl, whose reader this is)."""
    return read_metrics(path)
