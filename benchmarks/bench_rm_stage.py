"""RLVR then RM-GRPO on the embedded demo: held-out accuracy of the verifiable task before and after
the reward-model stage, and the reward model's raw score on the open prompts, per arm.

    python benchmarks/bench_rm_stage.py --out runs/rm_stage [--steps 40] [--set rm_stage.lr=1e-4 ...]

The demo's `fastgrpo train` (SFT → 200 GRPO steps) runs once in OUT/rlvr (reused when finished);
each arm copies that folder and runs the stage (fastgrpo/recipes/stages.py) on a mixed set of 64
sums (with answers) + 64 open prompts, rewards accuracy 1.0 + format 0.1 + marker 0.5, where
`marker` is the tiny reward model of tests/reward_models.py (trained here in seconds to prefer
texts holding "!", group-normalised). Arms: `every_row` (rm_stage.route=false: the RM scores the
sums too), `routed` (R1's split: the RM scores only the open prompts), `routed_kl` (routed,
rm_stage.beta=0.1). Prints one row per arm and writes OUT/rm_stage.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"every_row": ["rm_stage.route=false"], "routed": [], "routed_kl": ["rm_stage.beta=0.1"]}


def _train(out: str, sets) -> None:
    cmd = [sys.executable, "-m", "fastgrpo.cli", "train", "--out", out, "--set", "logging.progress=false",
           "--set", "logging.plots=false"] + [x for s in sets for x in ("--set", s)]
    with open(out + ".log", "w") as log:
        if subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed; see {out}.log")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/rm_stage")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))  # the tiny marker reward model of the tests
    from reward_models import train_marker_rm

    rm = os.path.join(out, "rm")
    if not os.path.isfile(os.path.join(rm, "config.json")):
        train_marker_rm(rm)
    rng = random.Random(0)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in ((rng.randrange(50), rng.randrange(50))
                                                                    for _ in range(64))]
    rows += [{"prompt": "".join(rng.choice("abcxyz") for _ in range(rng.randint(2, 5))) + ":"} for _ in range(64)]
    mixed = os.path.join(out, "mixed.jsonl")
    with open(mixed, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    rlvr = os.path.join(out, "rlvr")
    if not os.path.isfile(os.path.join(rlvr, "summary.json")):
        _train(rlvr, args.sets)
    stage = [f"rewards.models={{marker: {{path: {rm}, device: cpu, normalize: group}}}}",
             f"rm_stage.steps={args.steps}", f"rm_stage.prompts={mixed}", "rm_stage.functions=[accuracy, format, marker]",
             "rm_stage.weights=[1.0, 0.1, 0.5]"]
    res = {}
    print(f"{'arm':<12}{'acc before':>12}{'acc after':>12}{'RM raw first':>14}{'RM raw last':>13}")
    for arm, extra in ARMS.items():
        run = os.path.join(out, arm)
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(rlvr, run)
        _train(run, args.sets + stage + extra)
        with open(os.path.join(run, "rm_stage", "summary.json")) as f:
            summ = json.load(f)
        with open(os.path.join(run, "rm_stage", "metrics.jsonl")) as f:
            raw = [r["reward/marker/raw_mean"] for r in map(json.loads, f) if "reward/marker/raw_mean" in r]
        res[arm] = {**summ, "rm_raw_first": raw[0], "rm_raw_last": raw[-1]}
        print(f"{arm:<12}{summ['rm_stage/accuracy_before']:>12.3f}{summ['rm_stage/accuracy_after']:>12.3f}"
              f"{raw[0]:>14.2f}{raw[-1]:>13.2f}")
    with open(os.path.join(out, "rm_stage.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
