"""pytest plugin for running TRL's GRPO tests on the local stand-ins (`-p benchmarks.trl_suite.plugin`).

At import (before collection, so before the test module's own imports):
- `datasets.load_dataset` answers `trl-internal-testing/zen` from `stand_ins.load_dataset`;
  the models come from the stand-in hub cache the runner points `HF_HUB_CACHE` at (offline);
- with FASTGRPO_TRL_SUITE_TRAINER=fastgrpo, `trl.GRPOTrainer` is
  `fastgrpo.integrations.trl.FastGRPOTrainer`; after collection every test module's
  `GRPOTrainer` name is checked (and set) to be it, so a test cannot silently run stock TRL.
Version skew in TRL's test support files: an `is_<package>_available` that the staged tests import
from `trl.import_utils` and the installed TRL lacks is added there (`find_spec(<package>)`), and
named in the report header.
Every test's outcome is written as JSON to FASTGRPO_TRL_SUITE_RESULTS when the session ends;
with FastGRPOTrainer also, per test, the micro-batches each path computed (`__paths__`: fused,
objective, fallback, and the fallback reasons), summed over the trainers the test built.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from benchmarks.trl_suite import stand_ins
from benchmarks.trl_suite.run import loss_paths

TRAINER = os.environ.get("FASTGRPO_TRL_SUITE_TRAINER", "stock")
if TRAINER not in ("stock", "fastgrpo"):
    raise pytest.UsageError(f"FASTGRPO_TRL_SUITE_TRAINER={TRAINER!r}: expected 'stock' or 'fastgrpo'")

stand_ins.install_load_dataset()


def _shim_import_utils(folder):
    """Add the `trl.import_utils.is_<pkg>_available` names the staged tests import but the
    installed TRL lacks; returns their names."""
    import trl.import_utils as iu

    wanted = set()
    for name in sorted(os.listdir(folder)) if folder and os.path.isdir(folder) else ():
        if name.endswith(".py"):
            text = open(os.path.join(folder, name), encoding="utf-8").read()
            for block in re.findall(r"from trl\.import_utils import \(?([^)]*?)\)?\n(?!\s)", text + "\n"):
                wanted.update(re.findall(r"\bis_(\w+?)_available\b", block))
    added = []
    for pkg in sorted(wanted):
        fn = f"is_{pkg}_available"
        if not hasattr(iu, fn):
            setattr(iu, fn, lambda *a, _p=pkg, **k: importlib.util.find_spec(_p) is not None)
            added.append(fn)
    return added


_SHIMS = _shim_import_utils(os.environ.get("FASTGRPO_TRL_SUITE_TESTS"))
_TRAINER_CLS = None
if TRAINER == "fastgrpo":
    import trl

    from fastgrpo.integrations.trl import FastGRPOTrainer

    trl.GRPOTrainer = FastGRPOTrainer
    _TRAINER_CLS = FastGRPOTrainer

_trainers: list = []  # the FastGRPOTrainers the running test built (their fastgrpo_stats)
if _TRAINER_CLS is not None:
    _init = _TRAINER_CLS.__init__

    def _tracked_init(self, *args, **kwargs):
        _trainers.append(self)
        return _init(self, *args, **kwargs)

    _TRAINER_CLS.__init__ = _tracked_init

_outcomes: dict = {}


def pytest_report_header(config):
    shims = f"; added to trl.import_utils (missing in this TRL): {', '.join(_SHIMS)}" if _SHIMS else ""
    return f"fastgrpo trl_suite: trainer={TRAINER}, hub cache={os.environ.get('HF_HUB_CACHE')}{shims}"


def pytest_collection_modifyitems(session, config, items):
    shard = os.environ.get("FASTGRPO_TRL_SUITE_SHARD")  # "i/n": keep every n-th test from the i-th
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        keep = [it for k, it in enumerate(items) if k % n == i]
        config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k % n != i])
        items[:] = keep
    if _TRAINER_CLS is None:
        return
    for mod in {item.module for item in items if getattr(item, "module", None) is not None}:
        if "GRPOTrainer" in vars(mod):
            mod.GRPOTrainer = _TRAINER_CLS


def pytest_runtest_logreport(report):
    nid = report.nodeid
    if report.when == "teardown" and _TRAINER_CLS is not None:
        _outcomes.setdefault("__paths__", {})[nid] = loss_paths(_trainers)
        _trainers.clear()
    if report.when == "setup" and report.outcome != "passed":
        _outcomes[nid] = "skipped" if report.skipped and not hasattr(report, "wasxfail") else (
            "xfailed" if hasattr(report, "wasxfail") else "error")
    elif report.when == "call":
        if hasattr(report, "wasxfail"):
            _outcomes[nid] = "xfailed" if report.skipped else "xpassed"
        else:
            _outcomes[nid] = report.outcome  # passed / failed / skipped
    elif report.when == "teardown" and report.failed and _outcomes.get(nid) == "passed":
        _outcomes[nid] = "error"
    if report.failed and report.when in ("setup", "call", "teardown"):
        msg = str(getattr(report, "longreprtext", "") or "").strip().splitlines()
        _outcomes.setdefault("__errors__", {})[nid] = (msg[-1] if msg else "")[:500]


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FASTGRPO_TRL_SUITE_RESULTS")
    if path:
        with open(path, "w") as f:
            json.dump({"trainer": TRAINER, "outcomes": _outcomes}, f, indent=1, sort_keys=True)
