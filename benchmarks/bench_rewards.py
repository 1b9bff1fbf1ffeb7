"""Reward throughput on the persistent RewardPool: math verifications/s and sandboxed code
executions/s, per-item latency (median, p90, max) and the timeout tail (how far past its
deadline a runaway item is actually stopped).

No byte/FLOP floor applies (the work is symbolic algebra and process start-up), so the
reference points are measured side by side in the same run instead:
- math: the same batch verified in this process, one item after another (Math-Verify in the
  main thread, what a trainer without a pool does) vs the pool;
- code: one sandboxed run costs at least a Python start-up; `python -I -c pass` run directly is
  reported as that floor.

    python -m benchmarks.bench_rewards --workers 2 --math-items 256 --code-items 32
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from benchmarks.harness import Bench, Stats, time_fn
from fastgrpo.rewards import RewardPool, code_reward, math_reward
from fastgrpo.rewards.math import extract_answer, verify_one
from fastgrpo.rewards.sandbox.runner import run_python, sandbox_python

# Eight answer shapes; the number k makes every item distinct (no cache hit inside Math-Verify
# or the per-call de-duplication), so the rate is that of fresh verifications.
_MATH = [("<think>…</think><answer>\\frac{{{k}}}{{2}}</answer>", "{h}"), ("<answer>x={k}, x=3</answer>", "\\{{{k},3\\}}"),
         ("\\boxed{{(x+{k})^2}}", "x^2+{k2}x+{kk}"), ("<answer>(1,{k}]</answer>", "(1,{k}]"), ("Answer: {k}", "{k}"),
         ("<answer>1/{k}</answer>", "1/{k1}"), ("<answer>\\sqrt{{{kk}}}</answer>", "{k}"), ("<answer>{k} cm</answer>", "{k}")]


def _math_item(i):
    c, g = _MATH[i % len(_MATH)]
    k = i // len(_MATH) + 2
    f = dict(k=k, h=k / 2, k2=2 * k, kk=k * k, k1=k + 1)
    return c.format(**f), g.format(**f)
_CODE = "```python\ndef f(n):\n    return sum(range(n + 1)) + 0 * {i}\n```"  # {i}: distinct programs
_TESTS = "assert f(10) == 55\nassert f(0) == 0\nassert f(100) == 5050"


def _burn(n):
    """Pure-Python CPU work: the parallel-efficiency control of the machine itself."""
    return sum(range(n))


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def _item_latencies(pool, func, jobs, timeout):
    res = pool.map(func, jobs, timeout=timeout)
    return [r.seconds for r in res]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--math-items", type=int, default=256)
    ap.add_argument("--code-items", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=2.0, help="per-item timeout of the tail cases (s)")
    args = ap.parse_args(argv)
    bench = Bench("rewards")
    w = args.workers

    t0 = time.perf_counter()
    pool = RewardPool(num_workers=w)
    pool.map(abs, [(-1,)] * w, timeout=30.0)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    with RewardPool(num_workers=w) as p2:
        p2.map(abs, [(-1,)] * w, timeout=30.0)
        warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    with RewardPool(num_workers=w, context="spawn") as p3:
        p3.map(abs, [(-1,)] * w, timeout=30.0)
        spawn = time.perf_counter() - t0
    for case, s in (("pool start forkserver (cold)", cold), ("pool start forkserver (warm)", warm),
                    ("pool start spawn", spawn)):
        bench.add(case=case, shape=f"workers={w}", stats=Stats(s, s, s, [s]))

    try:
        # Control: how much parallelism the machine grants this process tree at all. On a shared
        # box with scheduler autogroups, the whole session gets one fair share however many
        # workers it runs, and this ratio (not the pool) caps the speedup of the rows below.
        k = 4 * w
        burn_inline = time_fn(lambda: [_burn(2_000_000) for _ in range(k)], repeats=args.repeats, warmup=1)
        burn_pool = time_fn(lambda: pool.map(_burn, [(2_000_000,)] * k, timeout=60.0), repeats=args.repeats, warmup=1)
        bench.add(case="control: cpu burn in-process", shape=f"n={k}", stats=burn_inline)
        bench.add(case="control: cpu burn pool", shape=f"n={k},workers={w}", stats=burn_pool,
                  extra={"speedup": burn_inline.median_s / burn_pool.median_s})
        n = args.math_items
        batch_no = iter(range(1, 10**6))

        def fresh():  # a new batch of distinct items per timed call: SymPy's caches stay cold
            b = next(batch_no)
            comps, golds = map(list, zip(*(_math_item(i + b * n * 8) for i in range(n))))
            return comps, golds, [(extract_answer(c), g, False, 4) for c, g in zip(comps, golds)]

        inline = time_fn(lambda: [verify_one(*j) for j in fresh()[2]], repeats=args.repeats, warmup=1)
        pooled = time_fn(lambda: math_reward(*fresh()[:2], pool=pool), repeats=args.repeats, warmup=1)
        comps, golds, jobs = fresh()
        lat = _item_latencies(pool, verify_one, jobs, 5.0)
        bench.add(case="math in-process sequential", shape=f"n={n}", stats=inline,
                  extra={"items_per_s": n / inline.median_s})
        bench.add(case="math pool", shape=f"n={n},workers={w}", stats=pooled,
                  extra={"items_per_s": n / pooled.median_s, "speedup": inline.median_s / pooled.median_s,
                         "item_med_ms": 1e3 * statistics.median(lat), "item_p90_ms": 1e3 * _q(lat, 0.9),
                         "item_max_ms": 1e3 * max(lat)})

        m = args.code_items
        floor = time_fn(lambda: subprocess.run([sandbox_python(True) or "python3", "-I", "-c", "pass"], check=True),
                        repeats=args.repeats, warmup=1)
        bench.add(case="python -I start (floor)", shape="1 process", stats=floor, extra={"items_per_s": 1 / floor.median_s})
        progs = [_CODE.format(i=i) for i in range(m)]
        code = time_fn(lambda: code_reward(progs, [_TESTS] * m, pool=pool), repeats=args.repeats, warmup=1)
        res = pool.map(run_python, [(p.split("\n", 1)[1].rsplit("```", 1)[0], _TESTS, 5.0) for p in progs], timeout=10.0)
        lat = [r.value.seconds for r in res]
        bench.add(case="code sandbox pool", shape=f"n={m},workers={w}", stats=code,
                  extra={"items_per_s": m / code.median_s, "item_med_ms": 1e3 * statistics.median(lat),
                         "item_p90_ms": 1e3 * _q(lat, 0.9), "item_max_ms": 1e3 * max(lat),
                         "isolation": pool.isolation_level()})

        # Timeout tail: one runaway item per worker next to 8 normal ones. runaway_ms is when
        # the runaway item's result came back (deadline + kill + respawn), wall_ms the batch.
        to = args.timeout
        tower = [("10**10**%d" % (10 + j), "3", False, 1) for j in range(w)]
        t0 = time.perf_counter()
        res = pool.map(verify_one, tower + jobs[:8], timeout=to)
        wall = time.perf_counter() - t0
        run_ms = [1e3 * r.seconds for r in res[:w]]
        bench.add(case="math timeout tail", shape=f"{w} runaway + 8, timeout={to}s", stats=Stats(wall, wall, wall, [wall]),
                  extra={"runaway_max_ms": max(run_ms), "overrun_ms": max(run_ms) - 1e3 * to,
                         "timeouts": sum(r.reason == "timeout" for r in res)})
        loops = [("while True:\n    pass  # %d" % j, _TESTS, to) for j in range(w)]
        normal = [(p.split("\n", 1)[1].rsplit("```", 1)[0], _TESTS, to) for p in progs[:8]]
        t0 = time.perf_counter()
        res = pool.map(run_python, loops + normal, timeout=to + 2.0)
        wall = time.perf_counter() - t0
        run_ms = [1e3 * r.value.seconds for r in res[:w]]
        bench.add(case="code timeout tail", shape=f"{w} runaway + 8, timeout={to}s", stats=Stats(wall, wall, wall, [wall]),
                  extra={"runaway_max_ms": max(run_ms), "overrun_ms": max(run_ms) - 1e3 * to,
                         "timeouts": sum(r.value.reason == "timeout" for r in res)})
    finally:
        pool.close()
    bench.finish()


if __name__ == "__main__":
    main()
