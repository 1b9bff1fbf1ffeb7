"""Thinking-mode fusion on the embedded demo: accuracy against the thinking budget in thinking and
non-thinking mode, before and after fusion, for a few seeds.

    python benchmarks/bench_fusion.py --out runs/fusion [--seeds 0 1] [--set fusion.steps=300 ...]

Per seed: the demo's `fastgrpo train` (SFT cold start → 200 GRPO steps; a run folder OUT/seed-N
that already holds a finished run is reused), then `fastgrpo fuse` on it (OUT/seed-N-fused),
each in its own process, with DEMO_FUSION below: the demo's interrupt is `</think>` (the tiny
character-level model has never seen Qwen3's English interrupt sentence; `--set
rollout.interrupt=` restores it) and half the thinking examples are cut by it
(`--set fusion.interrupted_fraction=0` is Qwen3's recipe). Prints
one table per seed — greedy held-out accuracy per budget in think / no-think mode before and
after fusion, the share of empty think spans and the completion length in no-think mode — and
writes OUT/fusion.json (every sweep row) and OUT/budget_sweep.png (mean over seeds).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the demo's fusion settings: the interrupt the character-level model can read; lr 1e-3 (the cold
# start's 3e-3 cost 15 points of think-mode accuracy in 100 steps); half the thinking examples cut
# by the interrupt (with 0, Qwen3's recipe, accuracy falls to ~0 below the full budget: README)
DEMO_FUSION = ["rollout.interrupt=</think>", "fusion.lr=1e-3", "fusion.steps=1500", "fusion.batch_size=64",
               "fusion.interrupted_fraction=0.5"]


def _run(cmd, log_path):
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); see {log_path}")
    return time.perf_counter() - t0


def run_seed(seed: int, out: str, extra):
    run = os.path.join(out, f"seed-{seed}")
    py = [sys.executable, "-m", "fastgrpo.cli"]
    train_s = 0.0
    if not os.path.isfile(os.path.join(run, "summary.json")):
        train_s = _run(py + ["train", "--out", run, "--set", f"seed={seed}", "--set", "logging.progress=false"],
                       os.path.join(out, f"seed-{seed}-train.log"))
    fused = os.path.join(out, f"seed-{seed}-fused")
    sets = [x for s in DEMO_FUSION + list(extra) for x in ("--set", s)]
    fuse_s = _run(py + ["fuse", "--out", fused, "--set", f"model.path={run}"] + sets,
                  os.path.join(out, f"seed-{seed}-fuse.log"))
    with open(os.path.join(fused, "fusion", "budget_sweep.json")) as f:
        sweep = json.load(f)
    with open(os.path.join(fused, "fusion", "traces.json")) as f:
        traces = json.load(f)
    return {"seed": seed, "train_s": train_s, "fuse_s": fuse_s, "traces": traces, **sweep}


def table(res) -> str:
    rows = {(st, x["mode"], x["fraction"]): x for st in ("before", "after") for x in res[st]}
    fracs = sorted({k[2] for k in rows})
    lines = [f"seed {res['seed']}: {res['traces']['kept']} verified traces of {res['traces']['rollouts']} rollouts, "
             f"full budget {res['traces']['full_budget']} tokens (fuse {res['fuse_s']:.0f} s)",
             f"{'budget':>8}" + "".join(f"{h:>13}" for h in ("think pre", "think post", "nothink pre", "nothink post",
                                                              "empty pre", "empty post", "len post"))]
    for fr in fracs:
        b = rows[("after", "think", fr)]["budget"]
        vals = [rows[("before", "think", fr)]["accuracy"], rows[("after", "think", fr)]["accuracy"],
                rows[("before", "no_think", fr)]["accuracy"], rows[("after", "no_think", fr)]["accuracy"],
                rows[("before", "no_think", fr)]["empty_think"], rows[("after", "no_think", fr)]["empty_think"],
                rows[("after", "no_think", fr)]["length_mean"]]
        lines.append(f"{fr:>5.2f}={b:<2}" + "".join(f"{v:>13.3f}" for v in vals[:6]) + f"{vals[6]:>13.1f}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench-fusion")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--set", dest="extra", action="append", default=[], help="extra `fastgrpo fuse` overrides")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = []
    for s in args.seeds:
        results.append(run_seed(s, args.out, args.extra))
        print(table(results[-1]), flush=True)
    with open(os.path.join(args.out, "fusion.json"), "w") as f:
        json.dump({"settings": DEMO_FUSION + list(args.extra), "seeds": results}, f, indent=1)
    sys.path.insert(0, ROOT)
    from fastgrpo.recipes.budget_sweep import plot_sweep

    def mean(stage):
        keys = [(x["mode"], x["fraction"], x["budget"]) for x in results[0][stage]]
        return [{"mode": m, "fraction": fr, "budget": b,
                 "accuracy": sum(next(x["accuracy"] for x in r[stage] if x["mode"] == m and x["fraction"] == fr)
                                 for r in results) / len(results)} for m, fr, b in keys]

    plot_sweep(os.path.join(args.out, "budget_sweep.png"), mean("before"), mean("after"))
    print(f"wrote {os.path.join(args.out, 'fusion.json')} and {os.path.join(args.out, 'budget_sweep.png')}")


if __name__ == "__main__":
    main()
