"""The JSON-lines records of a run folder (metrics.jsonl, samples.jsonl, eval_samples.jsonl): a
JSON-safe scalar, the repair of a torn last line before appending, and a reader that skips torn or
foreign lines. Shared by fastgrpo.logs.metrics (which re-exports them) and
fastgrpo.logs.samples.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List


def json_value(v):
    """JSON-safe scalar: tensors → float, NaN/Inf → None (json has no NaN)."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return v if (isinstance(v, int) or math.isfinite(v)) else None
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    return v


def end_torn_line(path: str) -> None:
    """Terminate a last line without its newline (a row cut by a kill or a full disk): the
    fragment stays in the file, as a line `read_metrics` skips, and new rows start clean."""
    try:
        with open(path, "rb+") as f:
            if f.seek(0, os.SEEK_END) == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
                f.flush()
                os.fsync(f.fileno())
    except FileNotFoundError:
        pass


def read_metrics(path: str) -> List[Dict[str, object]]:
    """Rows of a metrics.jsonl; a torn line (run killed mid-write, disk full) is skipped, and so
    is anything that is not a JSON object with a step (e.g. NUL bytes left by a crash)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def rewrite_lines(path: str, lines: List[bytes]) -> None:
    """Replace the file at `path` by `lines`, atomically (a temp file beside it, fsync, rename): a
    kill mid-rewrite leaves the old file or the new one, never half of one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(b"".join(lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
