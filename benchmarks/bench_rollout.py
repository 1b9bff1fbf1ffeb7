"""Built-in rollout engine on CPU: fastgrpo's TorchEngine vs HF `model.generate` (equivalent
sampling) vs the previous engine (the newest committed torch_engine.py before the fast decode
path, loaded from git; `--baseline-rev` picks another revision).

One call = P prompts × G samples, temperature 1, no top-k / top-p, at most `max_new_tokens`
tokens each, eos on, per-completion seeds for the engines (HF has none per row). HF generate
returns tokens only; the engines also return each token's sampling log-prob, so HF does less
work. HF generate and the previous engine are also timed with torch pinned to one thread (the
built-in engine picks one thread itself for these sizes), to separate the thread choice from the
other changes (lean decoder, prefill dedup, compaction, vectorised sampling and bookkeeping): on
a shared, busy 2-core machine a second OpenMP thread can make tiny matmuls 10-300x slower, so
`vs_hf` swings with the load while `vs_hf_1thread` is the steadier figure.

Side by side: every round runs each case once, in turn, so that all cases see the same machine
load; medians / p20 / p80 over the rounds after one warm-up round. tokens/s = completion tokens
generated in the call / its time. There is no FLOP floor here (framework overhead, not FLOPs,
sets the pace at these sizes); the figure is the ratio to HF generate, measured in one run.

    python -m benchmarks.bench_rollout --configs 64x2:8x8:32 128x2:16x8:32 --repeats 5
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import torch

from benchmarks.harness import Bench, Stats, _quantile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args) -> str:
    return subprocess.check_output(["git", *args], cwd=ROOT, stderr=subprocess.DEVNULL).decode()


def _previous_engine_class(rev: str = ""):
    """TorchEngine as committed at `rev`, or by default at the newest commit whose engine predates
    the fast decode path (no `_decode` import); None when git or such a commit is unavailable."""
    rel = "fastgrpo/rollout/torch_engine.py"
    try:
        revs = [rev] if rev else _git("log", "--format=%H", "--", rel).split()
        src = next((text for text in (_git("show", f"{r}:{rel}") for r in revs)
                    if rev or "fastgrpo.rollout.decoders" not in text), None)
    except Exception:
        return None
    if src is None:
        return None
    path = os.path.join(tempfile.mkdtemp(prefix="bench_rollout_"), "prev_torch_engine.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("prev_torch_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TorchEngine


def _parse_config(text: str) -> Tuple[int, int, int, int, int]:
    """'HIDDENxLAYERS:PROMPTSxGROUP:MAX_NEW' → ints."""
    try:
        model, batch, new = text.split(":")
        hidden, layers = (int(x) for x in model.split("x"))
        prompts, group = (int(x) for x in batch.split("x"))
        return hidden, layers, prompts, group, int(new)
    except ValueError:
        raise ValueError(f"--configs entry {text!r}: expected HIDDENxLAYERS:PROMPTSxGROUP:MAX_NEW, "
                         "e.g. 64x2:8x8:32") from None


def _cases(hidden, layers, prompts, group, max_new, seed, baseline_rev="") -> Tuple[Dict[str, Callable[[], int]], int]:
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.rollout.torch_engine import TorchEngine

    heads = max(1, hidden // 32)
    model, tok = build_tiny_model("qwen2", seed=seed, hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, num_key_value_heads=1, head_dim=32,
                                  intermediate_size=2 * hidden)
    model.eval()
    texts = [f"{7 * i + 3}+{13 * i + 5}=" for i in range(prompts)]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new, seed=seed)
    batch = prompts * group

    def engine_case(engine, threads=None):
        def run():
            prev = torch.get_num_threads()
            if threads is not None:
                torch.set_num_threads(threads)
            try:
                out = engine.generate(texts, group, sampling)
            finally:
                torch.set_num_threads(prev)
            return sum(len(c.token_ids) for g in out for c in g)
        return run

    enc = tok([t for t in texts for _ in range(group)], return_tensors="pt", padding=True, add_special_tokens=False)

    def hf_generate(threads=None):
        prev = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        finally:
            torch.set_num_threads(prev)
        new = out[:, enc.input_ids.shape[1]:]
        # tokens up to and including the first eos of each row (the rest is padding)
        is_eos = (new == tok.eos_token_id).int()
        after = is_eos.cumsum(-1) - is_eos
        return int((after == 0).sum())

    cases = {"fastgrpo TorchEngine": engine_case(TorchEngine(model, tok, max_batch_size=256)),
             "HF model.generate": hf_generate,
             "HF model.generate, 1 thread": lambda: hf_generate(threads=1)}
    prev = _previous_engine_class(baseline_rev)
    if prev is not None:
        cases["previous engine"] = engine_case(prev(model, tok, max_batch_size=256))
        cases["previous engine, 1 thread"] = engine_case(prev(model, tok, max_batch_size=256), threads=1)
    return cases, batch


def _stats(xs: List[float]) -> Stats:
    return Stats(statistics.median(xs), _quantile(xs, 0.2), _quantile(xs, 0.8), list(xs))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["64x2:8x8:32", "128x2:16x8:32"],
                    help="HIDDENxLAYERS:PROMPTSxGROUP:MAX_NEW per configuration")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds (>= 5 for a median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-rev", default="", help="git revision of the 'previous engine' (default: the "
                    "newest committed torch_engine.py without the fast decode path)")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        raise ValueError(f"--repeats={a.repeats}: expected an integer >= 1")
    bench = Bench("rollout")
    for text in a.configs:
        hidden, layers, prompts, group, max_new = _parse_config(text)
        cases, batch = _cases(hidden, layers, prompts, group, max_new, a.seed, a.baseline_rev)
        times: Dict[str, List[float]] = {k: [] for k in cases}
        toks: Dict[str, List[int]] = {k: [] for k in cases}
        for rnd in range(a.repeats + 1):            # round 0 is the warm-up
            for name, fn in cases.items():
                t0 = time.perf_counter()
                n = fn()
                dt = time.perf_counter() - t0
                if rnd:
                    times[name].append(dt)
                    toks[name].append(n)
        rate = {k: statistics.median(n / t for n, t in zip(toks[k], times[k])) for k in cases}
        shape = f"h{hidden}xL{layers},B={batch}({prompts}x{group}),new<={max_new}"
        for name in cases:
            bench.add(case=name, shape=shape, stats=_stats(times[name]),
                      extra={"tokens": int(statistics.median(toks[name])), "tok_per_s": round(rate[name], 1),
                             "vs_hf": round(rate[name] / rate["HF model.generate"], 2),
                             "vs_hf_1thread": round(rate[name] / rate["HF model.generate, 1 thread"], 2)})
    bench.finish()


if __name__ == "__main__":
    sys.exit(main())
