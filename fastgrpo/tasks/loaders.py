"""Rows of a dataset as plain dicts, from any of the forms a user has at hand.

`load_rows(source, split=…, limit=…)` reads a `.jsonl` / `.json` / `.parquet` / `.csv` file, a
Hugging Face `datasets` `save_to_disk` folder (a Dataset, or a DatasetDict and a split), another
folder of data files (`datasets.load_dataset(folder)`), or a hub id (`owner/name`, optionally
`owner/name:config`). Parquet goes through pyarrow and saved / hub datasets through `datasets`;
jsonl and csv are read here, line by line, so that an error names the line (a non-UTF-8 byte, an
invalid JSON line, a row that is not an object) and csv cells stay the text the user typed
("007" stays "007"; pyarrow's csv reader would make it 7).

A hub id is tried only when the hub answers: without a connection `datasets.load_dataset`
retries for ~25 s, so the endpoint is probed first (3 s) and an unreachable hub is one clear
error; with `HF_HUB_OFFLINE=1` the local cache is used and nothing is probed.
"""
from __future__ import annotations

import csv
import json
import os
import re
import socket
import threading
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")
_FILE_EXT = (".jsonl", ".json", ".parquet", ".csv")
_PROBE_S = 3.0  # seconds to reach the hub before calling it unreachable


class Rows(list):
    """A list of row dicts that remembers where each row came from (`locations[i]`: `file:line`
    or `file row i`, used in error messages) and its position in the source (`positions[i]`:
    the 0-based line of a jsonl file, else the row index; the default problem id)."""

    def __init__(self, rows=(), locations=(), positions=(), source: str = ""):
        super().__init__(rows)
        self.locations: List[str] = list(locations)
        self.positions: List[int] = list(positions)
        self.source = source

    def take(self, idx) -> "Rows":
        idx = list(idx)
        return Rows([self[i] for i in idx], [self.locations[i] for i in idx], [self.positions[i] for i in idx],
                    self.source)


def load_rows(source: str, split: Optional[str] = "train", limit: int = 0, field: str = "data.path") -> Rows:
    """The rows of `source` (see the module docstring); `split` picks a split of a dataset dict
    or hub dataset (None: the only split); `limit` > 0 keeps the first `limit` rows; `field`
    names the config field in errors."""
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"{field}={source!r}: expected a data file, a dataset folder or a hub id")
    if not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit={limit!r}: expected an integer >= 0 (0 = all rows)")
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext == ".jsonl":
            rows = _read_jsonl(path, limit)
        elif ext == ".json":
            rows = _read_json(path, limit)
        elif ext == ".parquet":
            rows = _read_parquet(path, limit)
        elif ext == ".csv":
            rows = _read_csv(path, limit)
        else:
            raise ValueError(f"{field}={source!r}: unsupported file type {ext or '(none)'}; expected one of "
                             f"{', '.join(_FILE_EXT)}, a datasets save_to_disk folder or a hub id")
    elif os.path.isdir(path):
        rows = _read_folder(path, split, limit, field)
    elif source.lower().endswith(_FILE_EXT) or source.startswith((".", "/", "~")) or not _HUB_ID.match(source):
        raise ValueError(f"{field}={source!r}: no such file or folder")
    else:
        rows = _read_hub(source, split, limit, field)
    return rows


def _head(n: int, limit: int) -> bool:
    """True once `limit` rows are read (limit 0 = no limit)."""
    return bool(limit) and n >= limit


def _object_row(value, where: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object (one row), got {type(value).__name__}")
    return value


def _read_jsonl(path: str, limit: int) -> Rows:
    out = Rows(source=path)
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            where = f"{path}:{i + 1}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
            if not line.strip():
                continue
            if _head(len(out), limit):
                break
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            out.append(_object_row(value, where))
            out.locations.append(where)
            out.positions.append(i)
    return out


def _read_text(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x})") from None


def _read_json(path: str, limit: int) -> Rows:
    """A JSON array of objects, an object holding one such array (`{"data": [...]}`), or JSON lines."""
    text = _read_text(path)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON lines in a .json file, as datasets reads it
            return _read_jsonl(path, limit)
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if isinstance(value, dict):
        lists = [k for k, v in value.items() if isinstance(v, list)]
        if len(lists) != 1:
            raise ValueError(f"{path}: expected a JSON array of row objects (or an object holding one array), "
                             f"got an object with keys {sorted(value)[:8]}")
        value = value[lists[0]]
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected a JSON array of row objects, got {type(value).__name__}")
    value = value[:limit] if limit else value
    return Rows([_object_row(v, f"{path} row {i}") for i, v in enumerate(value)],
                [f"{path} row {i}" for i in range(len(value))], range(len(value)), path)


def _read_parquet(path: str, limit: int) -> Rows:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 — pyarrow raises several types for a bad file
        raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    if limit:
        table = table.slice(0, limit)
    rows = table.to_pylist()
    return Rows(rows, [f"{path} row {i}" for i in range(len(rows))], range(len(rows)), path)


def _read_csv(path: str, limit: int) -> Rows:
    out = Rows(source=path)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                return out
            start = reader.line_num + 1
            for i, row in enumerate(reader):
                if _head(len(out), limit):
                    break
                where = f"{path}:{start}"
                if None in row:  # more cells than header names
                    raise ValueError(f"{where}: {len(reader.fieldnames) + len(row[None])} cells for "
                                     f"{len(reader.fieldnames)} header columns")
                out.append(dict(row))
                out.locations.append(where)
                out.positions.append(i)
                start = reader.line_num + 1
    except UnicodeDecodeError:
        _read_text(path)  # raises with the line of the bad byte
        raise
    except csv.Error as e:
        raise ValueError(f"{path}: not valid CSV ({e})") from None
    return out


def _dataset_rows(ds, limit: int, name: str) -> Rows:
    if limit and len(ds) > limit:
        ds = ds.select(range(limit))
    rows = ds.to_list()
    return Rows(rows, [f"{name} row {i}" for i in range(len(rows))], range(len(rows)), name)


def _pick_split(dd, split: Optional[str], source: str, field: str):
    names = list(dd.keys())
    if split is None:
        if len(names) != 1:
            raise ValueError(f"{field}={source!r}: a dataset with splits {names}; name the one to use "
                             f"(data.split / data.eval_split)")
        split = names[0]
    if split not in dd:
        raise ValueError(f"{field}={source!r}: no split {split!r}; the dataset has splits {names}")
    return dd[split], split


def _read_folder(path: str, split: Optional[str], limit: int, field: str) -> Rows:
    import datasets

    saved = any(os.path.isfile(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json", "dataset_info.json"))
    try:
        ds = datasets.load_from_disk(path) if saved else datasets.load_dataset(path)
    except Exception as e:  # noqa: BLE001 — datasets raises many types; one line naming the folder
        how = "a datasets save_to_disk folder" if saved else "a folder of data files"
        raise ValueError(f"{field}={path!r}: cannot read {how} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, path, field)
        return _dataset_rows(ds, limit, f"{path} [{split}]")
    return _dataset_rows(ds, limit, path)


def _hub_reachable() -> Optional[str]:
    """None when the hub's endpoint accepts a TCP connection within _PROBE_S, else why not.
    The probe runs in a thread: name resolution (getaddrinfo) ignores socket timeouts."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: List[Optional[str]] = ["timed out"]

    def probe():
        try:
            socket.create_connection((host, port), timeout=_PROBE_S).close()
            result[0] = None
        except OSError as e:
            result[0] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(_PROBE_S + 0.5)
    return None if result[0] is None else f"{host}:{port} {result[0]}"


def _read_hub(source: str, split: Optional[str], limit: int, field: str) -> Rows:
    import datasets
    from huggingface_hub import constants

    name, _, config = source.partition(":")
    if not constants.HF_HUB_OFFLINE:
        why = _hub_reachable()
        if why is not None:
            raise ValueError(f"{field}={source!r}: not a local file or folder, and the Hugging Face hub is "
                             f"unreachable ({why}); download the dataset and point {field} at it, or set "
                             f"HF_HUB_OFFLINE=1 to use a cached copy")
    try:
        ds = datasets.load_dataset(name, config or None)
    except Exception as e:  # noqa: BLE001 — one line naming the id, whatever datasets raised
        raise ValueError(f"{field}={source!r}: cannot load it from the Hugging Face hub "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''})") from None
    if isinstance(ds, datasets.DatasetDict):
        ds, split = _pick_split(ds, split, source, field)
        return _dataset_rows(ds, limit, f"{source} [{split}]")
    return _dataset_rows(ds, limit, source)
