"""Full fine-tuning vs LoRA policies (issue 24) on SmolLM2-135M-Instruct: trainer peak memory,
seconds per step by phase, bytes and seconds per weight sync, held-out accuracy after N steps over
seeds. LoRA covers every linear layer of the decoder at ranks 1, 16 and 64 and runs at 10× the full
learning rate ("LoRA Without Regret", Thinking Machines 2025).

    python -m benchmarks.bench_lora --steps 30 --seeds 0 1 2          # the issue's table (hours on 2 cores)
    python -m benchmarks.bench_lora --steps 4 --seeds 0 --no-eval     # memory / step time / sync only
    python -m benchmarks.bench_lora --smoke                           # the tiny model: proves the script

Each (method, seed) runs in its own process (`--row`), so its peak memory starts from a clean
allocator: peak = the process's peak RSS (ru_maxrss) − its RSS before the model was built, i.e. the
model, its gradients, AdamW's state and the activations (a reference copy too when β > 0; LoRA's
reference is the base with the adapter off: none). Workload: examples/smollm2_arithmetic/ (its
config: 4 prompts × G 8, 64-token cap, the built-in engine, β = 0), same data and seed per row.

Sync (formula: bytes = Σ numel · 4 over what is sent, float32): the built-in engine shares the
trainer's module, so a step's own sync phase is 0 for every row; the figure here is what an engine
with weights of its own (vLLM) is sent per sync — every parameter for full fine-tuning, the
adapter's tensors for LoRA — and the seconds of copying them into a second copy of the model (the
direct transport's in-place copies, fastgrpo.sync.direct), median of 5; for LoRA also the seconds of writing the
versioned adapter folder vLLM loads (fastgrpo.sync.adapter). The floor of a sync is its bytes at
memory bandwidth; the table reports bytes and seconds, the ratio to full is the figure.

Targets (issue 24): LoRA's step ≤ 1.0× full's; peak memory ≤ 0.6× full; sync bytes ≤ 5 % of full;
held-out lift within 5 points of full's on average.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "smollm2_arithmetic")
METHODS = {"full": 0, "lora-1": 1, "lora-16": 16, "lora-64": 64}
SMOKE = ["model.path=tiny", "threads=1", "sft_first=false", "rollout.group_size=4", "rollout.prompts_per_step=2",
         "rollout.max_new_tokens=8", "data.max_operand=10", "data.num_heldout=8", "eval.max_problems=4",
         "rewards.functions=[accuracy]", "rewards.weights=[1.0]", "optimizer.lr=1e-3"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _config(row, out: str):
    from fastgrpo.config import load_config

    rank, lr_mult = METHODS[row["method"]], (10.0 if METHODS[row["method"]] else 1.0)
    common = [f"seed={row['seed']}", f"steps={row['steps']}", f"logging.out_dir={out}", "logging.progress=false",
              "logging.tensorboard=false", "logging.plots=false", "checkpoint.every=0", "checkpoint.at_end=false",
              "checkpoint.resume=none", "eval.every=0"]
    if rank:
        common.append(f"model.lora.rank={rank}")
    if row["smoke"]:
        cfg = load_config(None, SMOKE + common)
    else:
        cfg = load_config(os.path.join(EXAMPLE, "config.yaml"),
                          common + [f"data.path={row['train']}", f"data.eval_path={row['test']}"] + row["extra"])
    cfg.optimizer.lr *= lr_mult  # LoRA at 10× the full learning rate
    return cfg


def run_row(row) -> dict:
    """One (method, seed): build, eval, train `steps`, eval, measure a sync; returns the figures."""
    import torch

    from fastgrpo.models import lora
    from fastgrpo.pipeline import load_run
    from fastgrpo.sync.adapter import AdapterFolders
    from fastgrpo.trainer.build import build_model
    from fastgrpo.trainer.evaluation import evaluate
    from fastgrpo.trainer.grpo import Trainer, seed_everything

    out = tempfile.mkdtemp(prefix="bench_lora_")
    cfg = _config(row, out)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    parts = load_run(cfg, log=lambda *a: None)
    task, rewards = parts.task, parts.rewards
    seed_everything(cfg.seed)
    base_rss = _rss_mb()
    model, tok = build_model(cfg.model)
    trainer = Trainer(cfg, model, tok, task, log=lambda *a: None)
    res = {"method": row["method"], "seed": row["seed"], "steps": row["steps"]}
    if row["eval"] and task.heldout:
        res["acc_before"] = evaluate(trainer.engine, task.heldout, rewards, cfg.eval, cfg.rollout)["eval/accuracy"]
    steps = []
    trainer.train(on_step=lambda s, m: steps.append(m))
    res["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss
    if row["eval"] and task.heldout:
        res["acc_after"] = evaluate(trainer.engine, task.heldout, rewards, cfg.eval, cfg.rollout)["eval/accuracy"]
    timed = steps[1:] or steps  # the first step is warm-up (kernel builds, allocator)
    for k in sorted({k for m in timed for k in m if k.startswith("timing/")}):
        res[k] = statistics.median([m.get(k, 0.0) for m in timed])
    module = trainer.backend.module
    named = (list(lora.adapter_named_tensors(module).items()) if lora.is_lora(module)
             else [(n, p) for n, p in module.named_parameters()])
    twin = copy.deepcopy(module)  # an engine with weights of its own
    if lora.is_lora(module):  # the twin's adapter by the same saved names
        tw = lora.adapter_named_tensors(twin)
        params = {n: p for n, p in twin.named_parameters()}
        by_ptr = {p.data_ptr(): n for n, p in params.items()}
        named = [(by_ptr[tw[k].data_ptr()], v) for k, v in named]
    dst = dict(twin.named_parameters())
    times = []
    for _ in range(5):  # the direct transport's copy (fastgrpo.sync.direct), of what is sent
        t0 = time.perf_counter()
        with torch.no_grad():
            for n, t in named:
                dst[n].copy_(t)
        times.append(time.perf_counter() - t0)
    res["sync_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    res["sync_s"] = statistics.median(times)
    res["sync_folder_s"] = None  # (the same columns in every row: the CSV's header is the first row's)
    if lora.is_lora(module):
        folders = AdapterFolders(os.path.join(out, "adapters"))
        res["sync_folder_s"] = statistics.median([folders.write(module)[2] for _ in range(3)])
    res["trainable"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    trainer.close()
    return res


def _table(results) -> str:
    by = {}
    for r in results:
        by.setdefault(r["method"], []).append(r)
    full = by.get("full")

    def mean(rows, k):
        xs = [r[k] for r in rows if r.get(k) is not None]
        return sum(xs) / len(xs) if xs else None

    lines = ["| method | trainable | peak MB | × full | s/step | rollout | update | × full | sync bytes | % full | "
             "sync s | held-out before → after (lift) |", "|" + "---|" * 12]
    for name, rows in by.items():
        step, peak, sb = mean(rows, "timing/step"), mean(rows, "peak_mb"), mean(rows, "sync_bytes")
        fstep, fpeak, fsb = (mean(full, k) for k in ("timing/step", "peak_mb", "sync_bytes")) if full else (None,) * 3
        acc = ""
        if mean(rows, "acc_after") is not None:
            b, a = mean(rows, "acc_before"), mean(rows, "acc_after")
            acc = f"{b:.3f} → {a:.3f} ({100 * (a - b):+.1f})"
        ratio = (lambda x, y: f"{x / y:.2f}" if x is not None and y else "")
        lines.append(f"| {name} | {int(mean(rows, 'trainable'))} | {peak:.0f} | {ratio(peak, fpeak)} | {step:.2f} | "
                     f"{mean(rows, 'timing/rollout') or 0:.2f} | {mean(rows, 'timing/update') or 0:.2f} | "
                     f"{ratio(step, fstep)} | {int(sb)} | {100 * sb / fsb if fsb else 0:.2f} | "
                     f"{mean(rows, 'sync_s'):.4f} | {acc} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluations (memory / time / sync only)")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, 2 steps, one seed: proves the script runs")
    ap.add_argument("--out", default=None, help="folder for data and results.json (default: a temp folder)")
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more config overrides")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.row:
        print("ROW " + json.dumps(run_row(json.loads(a.row))), flush=True)
        return None
    out = a.out or tempfile.mkdtemp(prefix="bench_lora_")
    os.makedirs(out, exist_ok=True)
    train = test = None
    if a.smoke:
        a.steps, a.seeds = min(a.steps, 2), a.seeds[:1]
    else:
        from benchmarks.bench_real_learning import _make_data

        train, test = _make_data(os.path.join(out, "data"))
    results = []
    for method in a.methods:
        for seed in a.seeds:
            row = dict(method=method, seed=seed, steps=a.steps, smoke=a.smoke, eval=not a.no_eval, train=train,
                       test=test, extra=a.extra)
            done = subprocess.run([sys.executable, "-m", "benchmarks.bench_lora", "--row", json.dumps(row)],
                                  cwd=ROOT, capture_output=True, text=True)
            got = [json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode or not got:
                raise SystemExit(f"bench_lora: row {method} seed {seed} failed (rc {done.returncode}):\n"
                                 f"{done.stderr[-3000:]}")
            results.append(got[0])
            print(f"{method} seed {seed}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                       for k, v in got[0].items()), flush=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    if not a.smoke:  # the smoke run proves the script; its tiny-model rows are not measurements
        _write_csv(results)
    print(_table(results))
    return results


def _write_csv(results) -> None:
    from benchmarks.harness import Bench

    # rows with held-out accuracy have two more columns: their own file (a CSV keeps its first header)
    bench = Bench("lora_learning" if any("acc_after" in r for r in results) else "lora")
    for r in results:
        bench.add(case=f"{r['method']} seed {r['seed']}", shape=f"steps={r['steps']}", peak_mb=r["peak_mb"],
                  extra={k: v for k, v in r.items() if k not in ("method", "seed", "steps", "peak_mb")})
    bench.finish()


if __name__ == "__main__":
    main()
