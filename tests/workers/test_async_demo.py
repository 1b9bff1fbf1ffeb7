"""`fastgrpo train --set rollout.mode=async` on the embedded demo learns as the colocated demo does:
held-out accuracy rises by at least 15 points (tests/trainer/test_convergence.py's schedule: 450
SFT steps, 80 GRPO steps of 32 prompts × G = 8, seed 0), here with one rollout worker on Ray and
η = 1. Measured on the 2-core box: 0.44 → 0.825 (+38.5 points), ~50 s in all (Ray and the
worker start in ~10 s)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEDULE = ["sft.steps=450", "steps=80", "rollout.prompts_per_step=32", "data.num_heldout=200",
            "eval.max_problems=200", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
            "logging.plots=false", "checkpoint.every=0", "checkpoint.at_end=false", "seed=0",
            "rollout.mode=async", "rollout.max_staleness=1"]


@pytest.mark.slow
def test_async_demo_lifts_heldout_accuracy(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-m", "fastgrpo.cli", "train", "--out", str(out)]
    for s in SCHEDULE:
        args += ["--set", s]
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    # issue 34: Ray's session folder (here a private one: tmp_path is too long a path for Ray's
    # sockets) is gone at the end, and Ray's token-authentication line stayed off the console
    import re

    m = re.search(r"Ray's session folder: (/tmp/fastgrpo-ray-[^,\s]+),", p.stdout)
    assert m and not os.path.exists(m.group(1)), p.stdout[-2000:]
    # Ray prints its token-authentication line only on some starts: when it does, it is in log.txt
    assert "Token authentication" not in p.stdout + p.stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "async/staleness_max" in r]
    assert len(steps) == 80 and max(r["async/staleness_max"] for r in steps) <= 1
    assert summary["steps"] == 80
    lift = summary["accuracy_after"] - summary["accuracy_before"]
    assert lift >= 0.15, f"held-out accuracy {summary['accuracy_before']:.3f} → {summary['accuracy_after']:.3f}"
