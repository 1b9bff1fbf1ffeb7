"""Run TRL's own GRPO test suite twice: stock `trl.GRPOTrainer`, then fastgrpo's `FastGRPOTrainer`.

    python -m benchmarks.trl_suite.run --trl /path/to/trl        # a TRL checkout (or its tests/test_grpo_trainer.py)

TRL's test files are copied from there into a work folder outside this repository
(`--work`, default ~/.cache/fastgrpo/trl_suite) as the package `trl_tests` (test_grpo_trainer.py
and what it imports: testing_utils.py, testing_constants.py, conftest.py, __init__.py, data/).
The hub models and datasets the tests load are answered by local stand-ins
(`benchmarks/trl_suite/stand_ins.py`, built once into <work>/hub; offline); the pytest plugin
`benchmarks/trl_suite/plugin.py` substitutes the trainer. Each run prints one line,
`<trainer>: N ran / N passed / N failed / N skipped` (plus xfailed / xpassed / errors when there
are any), and the tests that pass with stock TRL but not with FastGRPOTrainer are listed (exit
status 1 when there are any). Results per test: <work>/results-<trainer>.json.

Deselected by default (`--keep-vision` keeps them): `TestGRPOTrainerVLM`, the vision-language
tests: their stand-ins would be ten VLM families with image processors, not built here.
`TestGRPOTrainerSlow` needs an accelerator and skips itself on CPU (counted as skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEST_FILE = "test_grpo_trainer.py"
SUPPORT_FILES = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
PACKAGE = "trl_tests"
DEFAULT_DESELECT = ("TestGRPOTrainerVLM",)
TRAINERS = {"stock": "stock GRPOTrainer", "fastgrpo": "FastGRPOTrainer"}


def find_test_file(trl: str) -> str:
    """TRL's tests/test_grpo_trainer.py from a TRL checkout, its tests/ folder or the file itself."""
    if not trl:
        raise SystemExit("trl_suite: --trl PATH is required: a TRL checkout (its tests/test_grpo_trainer.py is run)")
    cands = [trl, os.path.join(trl, TEST_FILE), os.path.join(trl, "tests", TEST_FILE)]
    for c in cands:
        if os.path.isfile(c) and os.path.basename(c) == TEST_FILE:
            return os.path.abspath(c)
    raise SystemExit(f"trl_suite: no TRL GRPO test file at {trl!r} (looked for {', '.join(cands[1:])}); pass a TRL "
                     "checkout, e.g. `git clone https://github.com/huggingface/trl` or an extracted tests/ folder")


def referenced_models(test_file: str) -> List[str]:
    """The stand-in models (short names) that TRL's test file names: only those are built."""
    import re

    from benchmarks.trl_suite.stand_ins import ORG, model_ids

    text = open(test_file, encoding="utf-8").read()
    named = set(re.findall(re.escape(ORG) + r"/([A-Za-z0-9_.-]+)", text))
    return [m.split("/", 1)[1] for m in model_ids() if m.split("/", 1)[1] in named]


def stage_tests(test_file: str, work: str) -> str:
    """Copy TRL's test file and its support files into <work>/trl_tests; returns that folder."""
    src = os.path.dirname(test_file)
    dst = os.path.join(work, PACKAGE)
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.makedirs(dst)
    shutil.copy2(test_file, os.path.join(dst, TEST_FILE))
    for name in SUPPORT_FILES:
        p = os.path.join(src, name)
        if os.path.isfile(p):
            shutil.copy2(p, os.path.join(dst, name))
        elif name == "__init__.py":
            open(os.path.join(dst, name), "w").close()
        elif name != "testing_constants.py":
            raise SystemExit(f"trl_suite: {p} is missing: TRL's {TEST_FILE} imports it (pass a full tests/ folder)")
    if os.path.isdir(os.path.join(src, "data")):
        shutil.copytree(os.path.join(src, "data"), os.path.join(dst, "data"))
    return dst


def pytest_command(work: str, deselect, extra: List[str]) -> List[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "benchmarks.trl_suite.plugin", "-p", "no:cacheprovider",
           "-o", "addopts=", "--rootdir", work, "-v", "-rfE", "--tb=line", f"{PACKAGE}/{TEST_FILE}"]
    for d in deselect:
        cmd += ["--deselect", f"{PACKAGE}/{TEST_FILE}::{d}"]
    return cmd + list(extra)


def run_env(work: str, trainer: str, results: str, threads: Optional[int], shard: Optional[str] = None) -> Dict[str, str]:
    from benchmarks.trl_suite.stand_ins import offline_env

    env = dict(os.environ)
    env.update(offline_env(work))
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["FASTGRPO_TRL_SUITE_TRAINER"] = trainer
    env["FASTGRPO_TRL_SUITE_RESULTS"] = results
    env["FASTGRPO_TRL_SUITE_TESTS"] = os.path.join(work, PACKAGE)
    if shard:
        env["FASTGRPO_TRL_SUITE_SHARD"] = shard
    env.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU suite: TRL's conftest forces use_cpu then
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def counts(outcomes: Dict[str, str]) -> Dict[str, int]:
    c = {k: 0 for k in ("passed", "failed", "skipped", "xfailed", "xpassed", "error")}
    for nid, o in outcomes.items():
        if not nid.startswith("__"):
            c[o] = c.get(o, 0) + 1
    c["ran"] = sum(c.values())
    return c


def loss_paths(trainers) -> Dict[str, object]:
    """Micro-batches per path summed over `trainers`' fastgrpo_stats: {fused, objective, fallback,
    reasons: {reason: n}} (reasons of fallbacks only)."""
    out = {"fused": 0, "objective": 0, "fallback": 0, "reasons": {}}
    for t in trainers:
        st = getattr(t, "fastgrpo_stats", None)
        if st is None:
            continue
        out["fused"] += st.fused
        out["objective"] += sum(st.objective.values())
        out["fallback"] += sum(st.fallback.values())
        for r, n in st.fallback.items():
            out["reasons"][r] = out["reasons"].get(r, 0) + n
    return out


def path_line(paths: Dict[str, dict]) -> str:
    """How many tests ran fastgrpo's loss (fused or TRL's objective on fastgrpo's head) and how
    many computed a micro-batch with TRL's own loss, by reason."""
    ours = sum(1 for p in paths.values() if p["fused"] + p["objective"] > 0)
    fell = {n: p for n, p in paths.items() if p["fallback"] > 0}
    reasons: Dict[str, int] = {}
    for p in fell.values():
        for r in p["reasons"]:
            reasons[r] = reasons.get(r, 0) + 1
    line = f"FastGRPOTrainer loss paths: {ours} tests ran fastgrpo's loss; {len(fell)} fell back to TRL's loss"
    return line + (" (" + ", ".join(f"{r}: {k} tests" for r, k in sorted(reasons.items())) + ")" if reasons else "")


def result_line(trainer: str, outcomes: Dict[str, str]) -> str:
    c = counts(outcomes)
    line = f"{TRAINERS[trainer]}: {c['ran']} ran / {c['passed']} passed / {c['failed']} failed / {c['skipped']} skipped"
    extra = [f"{c[k]} {k}" for k in ("xfailed", "xpassed", "error") if c[k]]
    return line + (" (" + ", ".join(extra) + ")" if extra else "")


def regressions(stock: Dict[str, str], ours: Dict[str, str]) -> List[str]:
    """Tests that pass with stock GRPOTrainer and do not with FastGRPOTrainer."""
    return sorted(n for n, o in stock.items() if not n.startswith("__") and o in ("passed", "xpassed")
                  and ours.get(n) not in ("passed", "xpassed"))


def _tag(trainer: str, shard: Optional[str]) -> str:
    return trainer if not shard else f"{trainer}-shard{shard.replace('/', 'of')}"


def load_results(work: str, trainer: str) -> Optional[Dict[str, str]]:
    """The outcomes of one trainer's run(s) in `work`: results-<trainer>.json or its shards merged."""
    import glob

    paths = sorted(glob.glob(os.path.join(work, f"results-{trainer}.json")) +
                   glob.glob(os.path.join(work, f"results-{trainer}-shard*.json")))
    if not paths:
        return None
    merged: Dict[str, str] = {}
    for p in paths:
        with open(p) as f:
            o = json.load(f)["outcomes"]
        errs, paths = o.pop("__errors__", {}), o.pop("__paths__", {})
        merged.update(o)
        merged.setdefault("__errors__", {}).update(errs)
        merged.setdefault("__paths__", {}).update(paths)
    return merged


def run_one(work: str, trainer: str, deselect, extra, threads, log, shard: Optional[str] = None) -> Dict[str, str]:
    tag = _tag(trainer, shard)
    results = os.path.join(work, f"results-{tag}.json")
    if os.path.exists(results):
        os.remove(results)
    cmd = pytest_command(work, deselect, extra)
    log(f"[trl_suite] {TRAINERS[trainer]}: {' '.join(cmd[1:])}")
    t0 = time.time()
    log_path = os.path.join(work, f"pytest-{tag}.log")
    with open(log_path, "w") as out:
        rc = subprocess.call(cmd, cwd=work, env=run_env(work, trainer, results, threads, shard), stdout=out,
                             stderr=subprocess.STDOUT)
    if not os.path.exists(results):
        tail = open(log_path).read()[-3000:]
        raise SystemExit(f"trl_suite: the {trainer} run wrote no results (pytest exit {rc}):\n{tail}")
    with open(results) as f:
        outcomes = json.load(f)["outcomes"]
    log(f"[trl_suite] {TRAINERS[trainer]} finished in {time.time() - t0:.0f} s (pytest exit {rc}; log {log_path})")
    return outcomes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trl", required=False, default=None, help="a TRL checkout, its tests/ folder or test_grpo_trainer.py")
    ap.add_argument("--work", default=os.path.join(os.path.expanduser("~"), ".cache", "fastgrpo", "trl_suite"),
                    help="work folder (TRL's copied tests, the stand-in hub cache, logs, results)")
    ap.add_argument("--only", choices=sorted(TRAINERS), help="run one trainer only (compare later with --compare)")
    ap.add_argument("--compare", action="store_true", help="no run: compare the results files already in --work "
                    "(a trainer's shards are merged)")
    ap.add_argument("--shard", default=None, help="i/n: run every n-th test from the i-th (with --only; several "
                    "shards can run at once from one --work after it is staged; merge with --compare)")
    ap.add_argument("--no-stage", action="store_true", help="reuse the tests and stand-ins already in --work")
    ap.add_argument("--keep-vision", action="store_true", help="do not deselect TestGRPOTrainerVLM")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the pytest processes")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: extra pytest arguments (-k, -x, ...)")
    a = ap.parse_args(argv)
    extra = [x for x in a.pytest_args if x != "--"]
    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    if a.shard and not a.only:
        raise SystemExit("trl_suite: --shard needs --only stock|fastgrpo")
    if not a.compare and not a.no_stage:
        test_file = find_test_file(a.trl)
        stage_tests(test_file, work)
        from benchmarks.trl_suite.stand_ins import build_hub_cache, offline_env

        os.environ.update({k: v for k, v in offline_env(work).items() if k != "HF_HUB_CACHE"})
        build_hub_cache(os.path.join(work, "hub"), only=referenced_models(test_file))
        print(f"[trl_suite] TRL tests: {test_file}", flush=True)
    deselect = () if a.keep_vision else DEFAULT_DESELECT
    res: Dict[str, Dict[str, str]] = {}
    for trainer in ([a.only] if a.only else list(TRAINERS)):
        if a.compare:
            got = load_results(work, trainer)
            if got is None:
                raise SystemExit(f"trl_suite: --compare: no results-{trainer}*.json in {work} (run with --only "
                                 f"{trainer} first)")
            res[trainer] = got
            continue
        res[trainer] = run_one(work, trainer, deselect, extra, a.threads, lambda s: print(s, flush=True), a.shard)
    for trainer, outcomes in res.items():
        print(result_line(trainer, outcomes))
    if "fastgrpo" in res and res["fastgrpo"].get("__paths__"):
        print(path_line(res["fastgrpo"]["__paths__"]))
    if len(res) == 2:
        bad = regressions(res["stock"], res["fastgrpo"])
        errors = res["fastgrpo"].get("__errors__", {})
        stock_failed = sorted(n for n, o in res["stock"].items() if not n.startswith("__")
                              and o in ("failed", "error"))
        if stock_failed:
            print("failing with stock GRPOTrainer too:")
            for n in stock_failed:
                print(f"  {n}  [fastgrpo: {res['fastgrpo'].get(n)}]")
        if bad:
            print(f"{len(bad)} pass with stock GRPOTrainer but not with FastGRPOTrainer:")
            for n in bad:
                print(f"  {n}: {res['fastgrpo'].get(n)}  {errors.get(n, '')}")
            return 1
        print("every test that passes with stock GRPOTrainer passes with FastGRPOTrainer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
