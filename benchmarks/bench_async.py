"""Colocated lock-step vs the asynchronous schedule (rollout.mode=async, issue 23 item 8) on
SmolLM2-135M-Instruct and the arithmetic word problems of examples/smollm2_arithmetic/: the same
prompts, G, completion cap and optimizer in every row (the example's config), only the schedule
and the placement change.

Rows (each one run per seed, in a process of its own, so Ray and the CPU pinning start clean):
  colocated        lock-step in one process on both cores (torch's default threads): today's figure
  async eta=0/1/2  one rollout worker (built-in engine, 1 thread) pinned to one core and the trainer
                   (threads=1) to the other: equal resources and equal placement, only the
                   staleness bound η differs (η = 0 is lock-step across the two processes)
  asyncN-keep/-abort  η = N with rollout.inflight=keep / abort: weights that arrive during a call
                   load between two decode steps (the default, wait: at the next call)
  tail ...         the long-tail case: the same rows (η ≤ 1) at a completion cap of 256 (lengths
                   spread), fewer steps, one seed, no evaluation

Pinning: the child process pins itself to core 0 before Ray starts (Ray's daemons and the worker
inherit it; the worker's threads are re-pinned by pid after it is up), then every thread of the
trainer process moves to core 1 (`os.sched_setaffinity` per thread id: the call pins a thread,
not a process) and torch runs one thread on each side.

Measured per row: samples/s = P·G completions per step / seconds per step, over the steps after
the first (warm-up: decoder build, first allocations), and completion tokens/s (rows whose
policies learn at different paces sample different lengths: shorter answers make more samples/s);
the phase timeline as mean seconds per step of each `timing/<phase>` the trainer logs (in async, `rollout` is the trainer's wait for groups),
`async/wait_rollout` (seconds the worker sat idle for want of admitted prompts) and the sync;
held-out greedy accuracy (the example's eval.max_problems held-out problems) of weight snapshots
taken every --eval-every steps, against steps and against the run's own training wall-clock
(snapshots are written to disk during the run — about a second each, subtracted from the clock —
and evaluated after it, on both cores, so evaluation never stalls or frees either schedule).
Long-tail: the straggler time of lock-step is estimated as rollout · (1 − mean length / max length)
(the part of the rollout in which the batch is no longer full) and the report gives the share of
it the async η = 1 row recovers, (step time η=0 − step time η=1) / straggler time, capped at 1.
There is no byte/FLOP floor: the figures are the ratios at equal placement (target: η = 1 ≥ 1.4×
the η = 0 samples/s, bound (6.4 + 10.9)/10.9 = 1.59× on this 2-core box; accuracy at equal steps
within 5 points of η = 0). TRL beside them: benchmarks/bench_real_model.py.

    python -m benchmarks.bench_async                    # all rows, seeds 0 1 2, 30 steps, cap 64 + tail
    python -m benchmarks.bench_async --rows colocated async1 --seeds 0 --steps 10 --no-tail
    python -m benchmarks.bench_async --rows async0 async1 async1-keep --tail-only --tail-steps 6
    python -m benchmarks.bench_async --smoke --out /tmp/bench_async   # the tiny model, 2 steps: proves it runs

Writes OUT/bench_async.json (every run's per-step rows), benchmarks/results/bench_async.png
(OUT/ with --smoke) and appends the table to benchmarks/results/async.csv (harness.Bench).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "smollm2_arithmetic")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ROW_NAMES = ("colocated", "async0", "async1", "async2")
PHASES = ("rollout", "reward", "advantages", "pack", "old_logp", "update", "sync")
# the tiny model on the built-in arithmetic task: the same code path in seconds (--smoke)
SMOKE = ["model.path=tiny", "model.hidden_size=32", "model.num_hidden_layers=1", "model.intermediate_size=64",
         "model.num_attention_heads=2", "data.task=arithmetic", "data.max_operand=10", "data.num_heldout=10",
         "rollout.engine=torch", "rollout.group_size=4", "rollout.prompts_per_step=2", "optimizer.lr=5e-4",
         "rewards.functions=[accuracy]", "rewards.weights=[1.0]", "eval.max_problems=5",
         "sync.timeout=60", "cluster.object_store_mb=100"]
COMMON = ["eval.every=0", "checkpoint.every=0", "checkpoint.at_end=false", "logging.progress=false",
          "logging.plots=false", "logging.tensorboard=false"]


def row_overrides(name: str) -> List[str]:
    """Config overrides of a row (on top of the example's config and the common ones)."""
    if name == "colocated":
        return ["threads=0", "rollout.mode=colocated"]
    eta, _, inflight = name[5:].partition("-")
    if name.startswith("async") and eta.isdigit() and inflight in ("", "keep", "abort"):
        return ["threads=1", "rollout.mode=async", "rollout.workers=1", "rollout.worker_threads=1",
                f"rollout.max_staleness={int(eta)}"] + ([f"rollout.inflight={inflight}"] if inflight else [])
    raise ValueError(f"row {name!r}: expected one of {list(ROW_NAMES)} (asyncN: η = N; asyncN-keep / asyncN-abort: "
                     "weights loaded in the middle of a call, rollout.inflight)")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_async"), help="run folders and the JSON")
    ap.add_argument("--rows", nargs="+", default=list(ROW_NAMES), help=f"rows to run, of {list(ROW_NAMES)}")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cap", type=int, default=64, help="rollout.max_new_tokens of the main rows")
    ap.add_argument("--eval-every", type=int, default=10, help="weight snapshot for held-out accuracy every N steps")
    ap.add_argument("--tail-cap", type=int, default=256, help="completion cap of the long-tail rows")
    ap.add_argument("--tail-steps", type=int, default=8)
    ap.add_argument("--no-tail", action="store_true", help="skip the long-tail rows")
    ap.add_argument("--tail-only", action="store_true", help="the long-tail rows alone")
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-time cap of one run (it is killed past it)")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 2 steps, one seed, cap 8: proves the script runs")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides (every row)")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: one run described as JSON
    a = ap.parse_args(argv)
    for r in a.rows:
        row_overrides(r)  # a bad row name fails here, before anything runs
    if a.steps < 1 or a.eval_every < 1 or a.cap < 1 or a.tail_cap < 1 or a.tail_steps < 1:
        ap.error("--steps, --eval-every, --cap, --tail-cap and --tail-steps must be >= 1")
    if a.smoke:
        a.seeds, a.steps, a.cap, a.eval_every, a.tail_cap, a.tail_steps = [0], 2, 8, 2, 16, 2
    return a


def run_specs(a: argparse.Namespace, data: Optional[Dict[str, str]]) -> List[Dict]:
    """One spec per (row, seed) run, the long-tail rows last."""
    base = SMOKE if a.smoke else [f"data.path={data['train']}", f"data.eval_path={data['test']}"]
    config = None if a.smoke else os.path.join(EXAMPLE, "config.yaml")
    specs = []
    # seed by seed, the rows side by side: on a shared machine its speed drifts over an hour (seen: one
    # row's run 30 % slower than the same run the day before), so rows compared run adjacent in time
    plan = [] if a.tail_only else [(r, s, a.cap, a.steps, True) for s in a.seeds for r in a.rows]
    if not a.no_tail:
        plan += [(r, a.seeds[0], a.tail_cap, a.tail_steps, False) for r in a.rows if not r.startswith("async2")]
    for row, seed, cap, steps, evals in plan:
        label = row if evals else f"tail-{row}"
        run = os.path.join(a.out, f"{label}-cap{cap}-seed{seed}")
        over = (base + COMMON + row_overrides(row) + [f"seed={seed}", f"steps={steps}", f"rollout.max_new_tokens={cap}",
                                                      f"logging.out_dir={run}"] + list(a.extra))
        specs.append({"row": row, "label": label, "seed": seed, "cap": cap, "steps": steps, "config": config,
                      "overrides": over, "eval_every": a.eval_every if evals else 0, "run": run,
                      "async": row.startswith("async")})
    return specs


# ---------------------------------------------------------------------------------------------- child
def pin(pid: int, cores) -> None:
    """Every thread of `pid` onto `cores` (sched_setaffinity pins one thread id at a time)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:
            pass  # a thread that ended meanwhile


def child(spec: Dict) -> Dict:
    import torch

    from fastgrpo.config import load_config
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.evaluation import evaluate

    cores = sorted(os.sched_getaffinity(0))
    placed = spec["async"] and len(cores) >= 2
    if placed:  # Ray and its worker start from here: they inherit the worker's core
        pin(os.getpid(), {cores[0]})
    cfg = load_config(spec["config"], spec["overrides"])
    model, tok = build_model(cfg.model)
    if spec["async"]:
        from fastgrpo.trainer.async_trainer import AsyncTrainer as T
    else:
        from fastgrpo.trainer.grpo import Trainer as T
    t = T(cfg, model, tok, log=lambda m: None)
    if placed:
        for wpid in t.orchestrator.pool.pids:
            if wpid:
                pin(wpid, {cores[0]})
        pin(os.getpid(), {cores[1]})
        torch.set_num_threads(1)
    snaps, rows = [], []
    paused = 0.0

    def snapshot(step):
        nonlocal paused
        s0 = time.perf_counter()
        path = os.path.join(spec["run"], f"snapshot-{step}.pt")
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, path)
        snaps.append((step, wall, path))
        paused += time.perf_counter() - s0

    os.makedirs(spec["run"], exist_ok=True)
    ev = spec["eval_every"]
    t0 = time.perf_counter()
    wall = 0.0
    try:
        if ev:
            snapshot(0)
        for step in range(1, spec["steps"] + 1):
            logs = t.step()
            wall = time.perf_counter() - t0 - paused
            rows.append({"step": step, "wall": wall, **{k: float(v) for k, v in logs.items()
                                                        if isinstance(v, (int, float)) and not isinstance(v, bool)}})
            if ev and (step % ev == 0 or step == spec["steps"]):
                snapshot(step)
    finally:
        t.close()
    evals = []
    if snaps:  # after the run, on every core: evaluation stalls neither schedule
        pin(os.getpid(), set(cores))
        torch.set_num_threads(len(cores))
        engine = TorchEngine(model, tok, max_batch_size=256)
        for step, w, path in snaps:
            model.load_state_dict(torch.load(path))
            acc = evaluate(engine, t.task.heldout, t.reward_fns, cfg.eval, cfg.rollout, log=lambda m: None)
            evals.append({"step": step, "wall": w, "accuracy": float(acc["eval/accuracy"])})
            os.remove(path)
    return {"spec": spec, "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "placed": placed, "rows": rows, "evals": evals}


def run_one(spec: Dict, minutes: float) -> Dict:
    """One run in a fresh process (`--child`); its result, or the error it ended with."""
    os.makedirs(spec["run"], exist_ok=True)
    out = os.path.join(spec["run"], "bench_result.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps({**spec, "result": out})]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=minutes * 60, cwd=ROOT)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", str(e)[-300:]
    if rc == 0 and os.path.exists(out):
        with open(out) as f:
            return json.load(f)
    return {"spec": spec, "error": f"rc {rc}: {tail.strip().splitlines()[-1] if tail.strip() else ''}", "log_tail": tail}


# ---------------------------------------------------------------------------------------------- report
def summarize(res: Dict) -> Dict:
    """Per-run figures: samples/s and mean phase seconds over the steps after the first."""
    rows = res.get("rows") or []
    meas = rows[1:] or rows
    if not meas:
        return {}
    prev = {r["step"]: r["wall"] for r in rows}
    secs = [r["wall"] - prev.get(r["step"] - 1, 0.0) for r in meas]
    toks = [res["samples_per_step"] * r.get("completion/length_mean", 0.0) for r in meas]
    # tokens/s next to samples/s: two schedules whose policies learn at different paces also
    # sample different lengths (shorter answers are cheaper), which samples/s alone would credit
    out = {"s_per_step": statistics.median(secs), "step_times": secs,
           "samples_per_s": res["samples_per_step"] * len(meas) / max(sum(secs), 1e-9),
           "tokens_per_s": sum(toks) / max(sum(secs), 1e-9)}
    for ph in PHASES:
        vals = [r.get(f"timing/{ph}", 0.0) for r in meas]
        out[ph] = sum(vals) / len(vals)
    for k in ("async/wait_trainer", "async/wait_rollout", "async/staleness_mean", "async/version_span",
              "async/mismatch_kl", "async/is_ess",
              "completion/length_mean", "completion/length_max"):
        vals = [r[k] for r in meas if k in r]
        out[k] = sum(vals) / len(vals) if vals else None
    return out


def _mean_curve(results: List[Dict], key: str):
    """(x, mean accuracy) over seeds of one row's evaluations, x = step or wall seconds."""
    by: Dict[int, List] = {}
    for r in results:
        for e in r.get("evals", []):
            by.setdefault(e["step"], []).append((e["wall"], e["accuracy"]))
    pts = sorted(by.items())
    return ([s if key == "step" else statistics.mean(w for w, _ in v) for s, v in pts],
            [statistics.mean(a for _, a in v) for _, v in pts])


def plot(groups: Dict[str, List[Dict]], summaries: Dict[str, Dict], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    for label, results in groups.items():
        if any(r.get("evals") for r in results):
            for ax, key in ((a, "step"), (b, "wall")):
                xs, ys = _mean_curve(results, key)
                ax.plot(xs, ys, marker="o", label=f"{label} ({len(results)} seeds)")
    a.set(title="held-out greedy accuracy vs steps (mean over seeds)", xlabel="GRPO step", ylabel="accuracy")
    b.set(title="held-out accuracy vs training wall-clock", xlabel="seconds", ylabel="accuracy")
    labels = [k for k in summaries if summaries[k]]
    xs = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for ph in PHASES:  # the trainer's side, stacked (async: `rollout` is its wait for groups)
        vals = [summaries[k].get(ph) or 0.0 for k in labels]
        c.bar([x - 0.2 for x in xs], vals, width=0.4, bottom=bottom, label=f"trainer {ph}")
        bottom = [x + y for x, y in zip(bottom, vals)]
    idle = [summaries[k].get("async/wait_rollout") or 0.0 for k in labels]
    c.bar([x + 0.2 for x in xs], idle, width=0.4, color="black", label="rollout worker idle")
    c.set(title="phase timeline: mean seconds per step", ylabel="seconds")
    c.set_xticks(xs)
    c.set_xticklabels(labels, rotation=30, ha="right")
    for ax in (a, b, c):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def report(results: List[Dict], a: argparse.Namespace) -> Dict:
    from benchmarks.harness import RESULTS_DIR, Bench, Stats, _quantile

    groups: Dict[str, List[Dict]] = {}
    for r in results:
        groups.setdefault(f"{r['spec']['label']} cap{r['spec']['cap']}", []).append(r)
    summaries, bench = {}, Bench("async")
    for label, rs in groups.items():
        ok = [r for r in rs if "error" not in r]
        per = [summarize(r) for r in ok]
        per = [p for p in per if p]
        for r in rs:
            if "error" in r:
                print(f"{label} seed {r['spec']['seed']}: failed — {r['error']}", flush=True)
        if not per:
            summaries[label] = {}
            continue
        agg = {k: statistics.mean(p[k] for p in per if p.get(k) is not None)
               for k in per[0] if k != "step_times" and any(p.get(k) is not None for p in per)}
        times = [x for p in per for x in p["step_times"]]
        accs = {}
        for r in ok:
            for e in r.get("evals", []):
                accs.setdefault(e["step"], []).append(e["accuracy"])
        agg["acc_first"] = statistics.mean(accs[min(accs)]) if accs else None
        agg["acc_last"] = statistics.mean(accs[max(accs)]) if accs else None
        summaries[label] = agg
        extra = {"seeds": len(per), "samples_per_s": agg["samples_per_s"], "tokens_per_s": agg["tokens_per_s"],
                 **{f"{ph}_s": agg[ph] for ph in PHASES},
                 "worker_idle_s": agg.get("async/wait_rollout"), "staleness_mean": agg.get("async/staleness_mean"),
                 "acc_before": agg["acc_first"], "acc_after": agg["acc_last"]}
        bench.add(case=label, shape=f"P·G={ok[0]['samples_per_step']},steps={ok[0]['spec']['steps']}",
                  stats=Stats(statistics.median(times), _quantile(times, 0.2), _quantile(times, 0.8), times),
                  extra={k: v for k, v in extra.items() if v is not None})
    ratios = {}
    s = {k.split(" ")[0]: v for k, v in summaries.items() if k.endswith(f"cap{a.cap}") and v}
    for eta in (1, 2):
        if s.get(f"async{eta}") and s.get("async0"):
            ratios[f"eta{eta}_over_eta0_samples_per_s"] = s[f"async{eta}"]["samples_per_s"] / s["async0"]["samples_per_s"]
            ratios[f"eta{eta}_over_eta0_tokens_per_s"] = s[f"async{eta}"]["tokens_per_s"] / s["async0"]["tokens_per_s"]
            if s[f"async{eta}"].get("acc_last") is not None and s["async0"].get("acc_last") is not None:
                ratios[f"eta{eta}_minus_eta0_accuracy_points"] = 100 * (s[f"async{eta}"]["acc_last"] - s["async0"]["acc_last"])
    t0 = summaries.get(f"tail-async0 cap{a.tail_cap}")
    if t0 and t0.get("completion/length_max"):
        straggler = t0["rollout"] * (1 - t0["completion/length_mean"] / t0["completion/length_max"])
        ratios["tail_straggler_s_eta0"] = straggler
        for row in ("async1", "async1-keep", "async1-abort"):
            t1 = summaries.get(f"tail-{row} cap{a.tail_cap}")
            if t1:
                key = "tail_recovered_fraction" + ("" if row == "async1" else "_" + row.split("-")[1])
                ratios[key] = min(1.0, (t0["s_per_step"] - t1["s_per_step"]) / straggler) if straggler > 0 else 0.0
    csv_path = os.path.join(a.out, "async.csv") if a.smoke else None
    bench.finish(csv_path)
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    png = plot(groups, summaries, os.path.join(a.out if a.smoke else RESULTS_DIR, "bench_async.png"))
    if png:
        print(f"plot: {png}")
    return {"summaries": summaries, "ratios": ratios, "png": png}


def _make_data(out_dir: str) -> Dict[str, str]:
    spec = importlib.util.spec_from_file_location("make_data", os.path.join(EXAMPLE, "make_data.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    train, test = mod.make(out_dir)
    return {"train": train, "test": test}


def main(argv=None) -> Dict:
    a = parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        res = child(spec)
        with open(spec["result"], "w") as f:
            json.dump(res, f)
        return res
    os.makedirs(a.out, exist_ok=True)
    data = None if a.smoke else _make_data(os.path.join(a.out, "data"))
    results = []
    for spec in run_specs(a, data):
        t0 = time.time()
        r = run_one(spec, a.minutes)
        results.append(r)
        s = summarize(r) if "error" not in r else {}
        what = r.get("error") or f"{s.get('samples_per_s', 0):.2f} samples/s, {s.get('s_per_step', 0):.2f} s/step"
        print(f"{spec['label']} cap {spec['cap']} seed {spec['seed']}: {what} ({time.time() - t0:.0f} s)", flush=True)
    with open(os.path.join(a.out, "bench_async.json"), "w") as f:
        json.dump(results, f, indent=1)
    return {"results": results, **report(results, a)}


if __name__ == "__main__":
    main()
