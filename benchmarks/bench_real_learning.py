"""Learning on a real model: GRPO lifts SmolLM2-135M-Instruct's held-out accuracy on arithmetic
word problems (examples/smollm2_arithmetic/), several seeds, reward and accuracy curves plotted.

    python benchmarks/bench_real_learning.py --out runs/learning [--seeds 0 1 2] [--steps 30]
        [--minutes 30] [--config examples/smollm2_arithmetic/config.yaml] [--set optimizer.lr=1e-5 ...]

With the python tool (config_python.yaml: an SFT cold start on tool traces, then GRPO whose
episodes call the tool), and the same model trained the same way without the tool:

    python benchmarks/bench_real_learning.py --out runs/python --steps 15 \
        --config examples/smollm2_arithmetic/config_python.yaml
    python benchmarks/bench_real_learning.py --out runs/notool --steps 15 \
        --config examples/smollm2_arithmetic/config_python.yaml \
        --set "rollout.tools=[]" --set data.columns.completion=answer_turn

Each seed is one `fastgrpo train --config examples/smollm2_arithmetic/config.yaml` in its own
process (same data, the run's seed varied), capped at --minutes of wall time (a run past it is
stopped with SIGTERM, which checkpoints, and is reported as cut). Held-out accuracy is greedy on
the example's 60 held-out problems, at step 0 (the pretrained model), every 10 steps and at the
end (after the SFT cold start where the config has one; the pretrained model's own accuracy is
then one more eval, `fastgrpo eval`, with the run's prompts). Prints a table (accuracy before → after, the lift in points, minutes) and writes
OUT/learning.json and OUT/learning.png (mean reward per step and held-out accuracy per seed).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "smollm2_arithmetic")


def _make_data(out_dir: str):
    spec = importlib.util.spec_from_file_location("make_data", os.path.join(EXAMPLE, "make_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make(out_dir, traces=True)  # the tool traces too: config_python.yaml's cold start


def _rows(path: str):
    out = []
    if os.path.exists(path):
        for line in open(path):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def pretrained_accuracy(config: str, out: str, train: str, test: str, extra) -> float:
    """Held-out accuracy of the pretrained model with the config's prompts (tools included)."""
    cmd = [sys.executable, "-m", "fastgrpo.cli", "eval", "--config", config, "--out", os.path.join(out, "pretrained"),
           "--set", f"data.path={train}",
           "--set", f"data.eval_path={test}", "--set", "logging.progress=false"]
    for item in extra:
        cmd += ["--set", item]
    text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
    import re

    m = re.findall(r"accuracy[^0-9]*([01]\.[0-9]+)", text)
    if not m:
        raise RuntimeError(f"fastgrpo eval gave no accuracy:\n{text[-800:]}")
    return float(m[-1])


def run_seed(seed: int, out: str, train: str, test: str, steps: int, minutes: float, extra, config: str = ""):
    run = os.path.join(out, f"seed-{seed}")
    cmd = [sys.executable, "-m", "fastgrpo.cli", "train", "--config", config or os.path.join(EXAMPLE, "config.yaml"),
           "--out", run, "--set", f"seed={seed}", "--set", f"steps={steps}", "--set", f"data.path={train}",
           "--set", f"data.eval_path={test}", "--set", "logging.progress=false"]
    for item in extra:
        cmd += ["--set", item]
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cut = False
    try:
        text, _ = p.communicate(timeout=minutes * 60)
    except subprocess.TimeoutExpired:
        cut = True
        p.send_signal(signal.SIGTERM)
        text, _ = p.communicate(timeout=300)
    mins = (time.time() - t0) / 60
    rows = _rows(os.path.join(run, "metrics.jsonl"))
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    rewards = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    before = evals[0][1] if evals and evals[0][0] == 0 else None
    after = evals[-1][1] if len(evals) > 1 else None
    return {"seed": seed, "rc": p.returncode, "cut": cut, "minutes": mins, "before": before, "after": after,
            "lift_points": None if before is None or after is None else 100 * (after - before),
            "evals": evals, "rewards": rewards, "log_tail": text[-800:]}


def plot(results, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        if r["rewards"]:
            xs, ys = zip(*r["rewards"])
            a.plot(xs, ys, label=f"seed {r['seed']}", alpha=0.8)
        if r["evals"]:
            xs, ys = zip(*r["evals"])
            b.plot(xs, ys, marker="o", label=f"seed {r['seed']}")
    a.set(title="mean reward per GRPO step", xlabel="step", ylabel="reward")
    b.set(title="held-out greedy accuracy", xlabel="step", ylabel="accuracy")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/bench_real_learning")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--minutes", type=float, default=30.0, help="wall-time cap per seed")
    ap.add_argument("--config", default=os.path.join(EXAMPLE, "config.yaml"))
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    train, test = _make_data(os.path.join(a.out, "data"))
    from fastgrpo.config import load_config

    cfg = load_config(a.config, a.extra)
    base = pretrained_accuracy(a.config, a.out, train, test, a.extra) if cfg.sft_first else None
    if base is not None:
        print(f"pretrained model: held-out accuracy {base:.3f} (before the SFT cold start)", flush=True)
    results = []
    for s in a.seeds:
        r = run_seed(s, a.out, train, test, a.steps, a.minutes, a.extra, a.config)
        r["pretrained"] = base
        results.append(r)
        lift = "n/a" if r["lift_points"] is None else f"{r['lift_points']:+.1f}"
        cut = " (cut at the time cap)" if r["cut"] else ""
        print(f"seed {s}: held-out accuracy {r['before']} → {r['after']} ({lift} points) in "
              f"{r['minutes']:.1f} min{cut}, rc {r['rc']}", flush=True)
    with open(os.path.join(a.out, "learning.json"), "w") as f:
        json.dump({"config": a.config, "overrides": a.extra, "pretrained": base, "seeds": results}, f, indent=1)
    plot(results, os.path.join(a.out, "learning.png"))
    first = "after SFT" if base is not None else "before"
    print(f"\n| seed | pretrained | {first} | after {a.steps} steps | lift (points) | minutes |\n|---|---|---|---|---|---|")
    for r in results:
        start = base if base is not None else r["before"]
        lift = "n/a" if start is None or r["after"] is None else f"{100 * (r['after'] - start):+.1f}"
        print(f"| {r['seed']} | {'n/a' if start is None else f'{start:.3f}'} | {r['before']} | {r['after']} | {lift} | "
              f"{r['minutes']:.1f} |")
    return results


if __name__ == "__main__":
    main()
