"""`build_task(DataConfig, …)`: a run config's data section → a task, every row checked.

Kinds: `arithmetic` (the embedded demo; `auto` without data.path), `math` (`auto` with a path,
and `jsonl`, the older name), `code` (`auto` when a `tests` column is mapped or present). Splits:
data.eval_path (a second source), else data.eval_split (another split of a dataset dict), else a
seeded data.eval_fraction of path's rows (deterministic for a seed, disjoint), else no held-out
set. data.limit keeps the first N rows of path (before any split). Few-shot rows (the first k
train rows with a reference completion) are shown before every prompt and kept out of both splits.

Ids: the rows' integer `id` column when it is unique over train + heldout; otherwise each row's
position in its source (the 0-based line of a jsonl file, else the row index; held-out rows of a
second source are offset past the train ids), with the user's id kept as `Problem.key`.

Every bad input — a missing mapped column, an empty prompt, a prompt over the token cap, a
reference answer the extractor cannot read, tests that do not compile, a chat template asked for
and absent — is a ValueError with one line naming the file / row / field, raised here, before
any model or engine starts.
"""
from __future__ import annotations

import logging
import random
import re
from typing import Dict, List, Optional, Tuple

from fastgrpo.config import DataConfig
from fastgrpo.tasks.base import Problem, Task
from fastgrpo.tasks.code import CodeTask, tests_text
from fastgrpo.tasks.formatting import PromptFormatter, check_trace, completion_text, prompt_lengths, row_turns
from fastgrpo.tasks.loaders import Rows, load_rows
from fastgrpo.tasks.math import JsonlTask, MathTask, check_references, make_extractor, reference_answer

logger = logging.getLogger("fastgrpo.tasks")

FIELDS = ("prompt", "messages", "answer", "tests", "id", "completion")
_INT_TEXT = re.compile(r"^-?\d+$")


def task_kind(dcfg: DataConfig, first_row: Optional[dict] = None) -> str:
    """arithmetic | math | code | jsonl for a data config (and the first train row, for auto)."""
    if dcfg.task == "arithmetic" or (dcfg.task == "auto" and not dcfg.path):
        return "arithmetic"
    if dcfg.task != "auto":
        return dcfg.task
    tests_col = dcfg.columns.get("tests", "tests")
    return "code" if "tests" in dcfg.columns or (first_row is not None and tests_col in first_row) else "math"


def _col(row: dict, column: str, field: str, where: str, mapped: bool, required: bool = True):
    """row[column]; a missing column is an error when it is mapped or required, else None."""
    if column not in row:
        if not (mapped or required):
            return None
        how = f"data.columns.{field}={column}" if mapped else f"the default {field} column"
        raise ValueError(f"{where}: no column {column!r} ({how}); the row has columns {sorted(row)[:12]}")
    return row[column]


def _split(dcfg: DataConfig) -> Tuple[Rows, Rows]:
    train = load_rows(dcfg.path, split=dcfg.split, limit=dcfg.limit, field="data.path")
    if not train:
        raise ValueError(f"data.path={dcfg.path!r}: no rows")
    if dcfg.eval_fraction and (dcfg.eval_path or dcfg.eval_split):
        raise ValueError(f"data.eval_fraction={dcfg.eval_fraction}: set it or data.eval_path / data.eval_split, not both")
    if dcfg.eval_path:
        held = load_rows(dcfg.eval_path, split=dcfg.eval_split, field="data.eval_path")
    elif dcfg.eval_split:
        if dcfg.eval_split == dcfg.split:
            raise ValueError(f"data.eval_split={dcfg.eval_split!r}: the same split as data.split (held-out rows "
                             f"would be trained on)")
        held = load_rows(dcfg.path, split=dcfg.eval_split, field="data.path")
    elif dcfg.eval_fraction > 0:
        n = len(train)
        k = min(max(1, round(n * dcfg.eval_fraction)), n - 1)
        if n < 2:
            raise ValueError(f"data.eval_fraction={dcfg.eval_fraction}: data.path has {n} row; a held-out "
                             f"fraction needs at least 2")
        picked = set(random.Random(dcfg.seed).sample(range(n), k))
        held = train.take(sorted(picked))
        train = train.take(i for i in range(n) if i not in picked)
    else:
        held = Rows(source="")
    return train, held


def _ids(train: Rows, held: Rows, id_col: Optional[str]) -> Tuple[List[int], List[int], List[str], List[str]]:
    """(train ids, held ids, train keys, held keys): see the module docstring."""
    rows = list(train) + list(held)
    locs = train.locations + held.locations
    raw = [r.get(id_col) for r in rows] if id_col else []
    keys = [loc if v is None else str(v) for v, loc in zip(raw, locs)] if id_col else list(locs)

    def as_int(v):
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, str) and _INT_TEXT.match(v.strip()):
            return int(v)
        return None

    ints = [as_int(v) for v in raw]
    if id_col and all(i is not None for i in ints) and len(set(ints)) == len(ints):
        return ints[:len(train)], ints[len(train):], keys[:len(train)], keys[len(train):]
    if id_col:
        why = "not all integers" if any(i is None for i in ints) else "not unique"
        logger.warning("data: column %r is %s over train + heldout; problems are numbered by position and keep the "
                       "column's value as their key", id_col, why)
    same = held.source == train.source and held.source != ""
    offset = 0 if same or not train.positions else max(train.positions) + 1
    return (list(train.positions), [p + offset for p in held.positions], keys[:len(train)], keys[len(train):])


def build_task(dcfg: DataConfig, tokenizer=None, context_len: Optional[int] = None, max_new_tokens: int = 0,
               pool=None, tools=None):
    """The task of a data config (see the module docstring).

    Args:
        dcfg: the run config's `data` section.
        tokenizer: the model's tokenizer: its chat template formats prompts (data.chat_template)
            and it counts prompt tokens; None = raw text, no length check.
        context_len: the model's context (max_position_embeddings); with max_new_tokens it caps
            prompts when data.max_prompt_tokens is 0.
        max_new_tokens: the completion cap (rollout.max_new_tokens).
        pool: the RewardPool the task's rewards use (and the load-time reference check); None =
            the process-wide default pool.
        tools: multi-turn tools, (JSON schemas, their fallback system text, whether the chat
            template renders `tools=`) (fastgrpo.trainer.build.load_episode_parts); None = none.
    """
    kind = task_kind(dcfg)
    if kind == "arithmetic":
        from fastgrpo.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask.from_config(dcfg, tools)
    bad = [k for k in dcfg.columns if k not in FIELDS]
    if bad:
        raise ValueError(f"data.columns.{bad[0]}: unknown problem field; expected fields among {list(FIELDS)}")
    if "prompt" in dcfg.columns and "messages" in dcfg.columns:
        raise ValueError("data.columns: map either prompt or messages, not both")
    train_rows, held_rows = _split(dcfg)
    kind = task_kind(dcfg, train_rows[0])
    cols = dict(dcfg.columns)
    first, where0 = train_rows[0], train_rows.locations[0]
    if "prompt" not in cols and "messages" not in cols:
        if "prompt" in first:
            cols["prompt"] = "prompt"
        elif "messages" in first:
            cols["messages"] = "messages"
        else:
            raise ValueError(f"{where0}: no 'prompt' or 'messages' column (the row has columns {sorted(first)[:12]}); "
                             f"map one with data.columns.prompt=<column>")
    prompt_field = "prompt" if "prompt" in cols else "messages"
    present = set().union(*(r.keys() for r in train_rows))
    for f in ("answer", "tests", "id", "completion"):
        if f not in cols and f in present:  # optional columns may be absent from some jsonl rows
            cols[f] = f
    if kind in ("math", "jsonl") and "answer" not in cols:
        _col(first, "answer", "answer", where0, False)
    if kind == "code" and "tests" not in cols:
        _col(first, "tests", "tests", where0, False)
    mapped = set(dcfg.columns)

    def parse(row: dict, where: str, held: bool = False):
        if "id" in mapped:
            _col(row, cols["id"], "id", where, True)
        turns = row_turns(_col(row, cols[prompt_field], prompt_field, where, prompt_field in mapped), where,
                          cols[prompt_field])
        comp = None
        if turns[-1]["role"] == "assistant":  # a chat row's final answer turn(s): its reference completion
            last_user = max((j for j, t in enumerate(turns) if t["role"] == "user"), default=-1)
            tail = turns[last_user + 1:]
            if last_user < 0 or tail[0]["role"] != "assistant":
                raise ValueError(f"{where}: column {cols[prompt_field]!r} has no user message before its assistant turn")
            if any(t["role"] == "tool" for t in tail):  # a tool trace: the model's turns and the tool answers
                comp, turns = check_trace(tail, where, cols[prompt_field]), turns[:last_user + 1]
            else:
                comp, turns = turns[-1]["content"] or None, turns[:-1]
        if "completion" in cols:
            # a mapped completion column is required of train rows only: held-out rows are never trained on
            comp = completion_text(_col(row, cols["completion"], "completion", where, "completion" in mapped and not held,
                                        False),
                                   where, cols["completion"]) or comp
        return turns, comp

    train_parsed = [parse(r, w) for r, w in zip(train_rows, train_rows.locations)]
    held_parsed = [parse(r, w, held=True) for r, w in zip(held_rows, held_rows.locations)]
    fmt = PromptFormatter(tokenizer, dcfg.chat_template, dcfg.system_prompt, dcfg.enable_thinking, tools=tools)
    shot_idx: List[int] = []
    if dcfg.few_shot:
        shot_idx = [i for i, (_, c) in enumerate(train_parsed) if c][:dcfg.few_shot]
        if len(shot_idx) < dcfg.few_shot:
            raise ValueError(f"data.few_shot={dcfg.few_shot}: only {len(shot_idx)} train rows of {dcfg.path!r} have a "
                             f"reference completion (column {cols.get('completion', 'completion')!r})")
        fmt.shots = [train_parsed[i] for i in shot_idx]
    shot_set = set(shot_idx)
    keep = [i for i in range(len(train_rows)) if i not in shot_set]
    shots_rows = train_rows.take(shot_idx)
    train_rows = train_rows.take(keep)
    train_parsed = [train_parsed[i] for i in keep]
    if not train_rows:
        raise ValueError(f"data.few_shot={dcfg.few_shot}: no train rows of {dcfg.path!r} are left after the examples")
    train_ids, held_ids, train_keys, held_keys = _ids(train_rows, held_rows, cols.get("id"))

    fmt_name = dcfg.answer_format
    if kind in ("math", "jsonl"):
        make_extractor(fmt_name, dcfg.answer_tag)  # checks the format once, before any row

    def problem(row, where, parsed, pid, key) -> Problem:
        turns, comp = parsed
        answer, tests = "", None
        if kind in ("math", "jsonl"):
            answer = reference_answer(_col(row, cols["answer"], "answer", where, "answer" in mapped), fmt_name,
                                      dcfg.answer_tag, where, cols["answer"])
        elif "answer" in cols and row.get(cols["answer"]) is not None:
            answer = str(row[cols["answer"]])
        if kind == "code":
            tests = tests_text(_col(row, cols["tests"], "tests", where, "tests" in mapped), where, cols["tests"])
        return Problem(id=pid, prompt=fmt.prompt(turns, where), answer=answer, tests=tests,
                       completion=fmt.completion(turns, comp, where) if comp else None, key=key, row=dict(row))

    train = [problem(r, w, p, i, k) for r, w, p, i, k in
             zip(train_rows, train_rows.locations, train_parsed, train_ids, train_keys)]
    heldout = [problem(r, w, p, i, k) for r, w, p, i, k in
               zip(held_rows, held_rows.locations, held_parsed, held_ids, held_keys)]
    where = {p.id: w for p, w in zip(train + heldout, train_rows.locations + held_rows.locations)}
    _check_lengths(train + heldout, where, tokenizer, dcfg.max_prompt_tokens, context_len, max_new_tokens)
    if kind in ("math", "jsonl"):
        check_references(train + heldout, where, pool=pool, column=cols["answer"])
    shots = [Problem(id=-1 - j, prompt=fmt.plain(t), completion=c, key=w, row=dict(r))
             for j, ((t, c), r, w) in enumerate(zip(fmt.shots, shots_rows, shots_rows.locations))]
    if kind == "code":
        task: Task = CodeTask(train, heldout, few_shot=shots, source=dcfg.path)
    else:
        cls = JsonlTask if kind == "jsonl" else MathTask
        task = cls(train, heldout, dcfg.answer_format, dcfg.answer_tag, few_shot=shots, source=dcfg.path)
    task.chat_template_applied = fmt.use_template  # whether prompts went through the tokenizer's chat template
    # the tool schemas the template renders (`tools=`), for SFT to render tool traces as the episodes do
    task.tool_schemas = tools[0] if tools is not None and tools[2] else None
    return task


def _check_lengths(problems: List[Problem], where: Dict[int, str], tokenizer, max_prompt_tokens: int,
                   context_len: Optional[int], max_new_tokens: int) -> None:
    if tokenizer is None:
        return
    if max_prompt_tokens:
        cap, why = max_prompt_tokens, f"data.max_prompt_tokens={max_prompt_tokens}"
    elif context_len:
        cap = context_len - max_new_tokens
        why = f"the model's context {context_len} − rollout.max_new_tokens {max_new_tokens}"
        if cap <= 0:
            raise ValueError(f"rollout.max_new_tokens={max_new_tokens}: leaves no room for a prompt in the model's "
                             f"context of {context_len} tokens")
    else:
        return
    for p, n in zip(problems, prompt_lengths(tokenizer, [p.prompt for p in problems])):
        if n > cap:
            raise ValueError(f"{where[p.id]}: the prompt is {n} tokens, over the cap of {cap} ({why}); shorten it, "
                             f"raise data.max_prompt_tokens or lower data.few_shot")
        if n == 0:
            raise ValueError(f"{where[p.id]}: the prompt encodes to no tokens")
