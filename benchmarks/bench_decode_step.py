"""One decode step of the built-in engine's lean decoder: the native step (csrc/jit/decode_step.cpp) vs the
Python step, side by side (the two alternate within each repeat), on the same KV caches; and one
step's sampling (csrc/jit/decode_step.cpp's sample_step vs the Python `pick` and bookkeeping).

Cases: rows × cached positions, on one thread (where the engine runs the native step). The
step's work is the model's GEMMs (2·rows·params FLOPs) plus reading the KV cache (rows · layers
· 2 · Hkv · positions · head_dim floats, the bound at long positions); the figure reported is
the time per step and the ratio.

    python -m benchmarks.bench_decode_step --hidden 64 --layers 2
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.harness import Bench, time_interleaved


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen2", choices=["qwen2", "qwen3", "llama"],
                    help="tiny model architecture (qwen3: with its per-head q / k norms)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 16])
    ap.add_argument("--positions", type=int, nargs="+", default=[8, 68, 208])
    ap.add_argument("--repeats", type=int, default=300)
    a = ap.parse_args(argv)
    for name in ("hidden", "layers", "heads", "repeats"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name}={getattr(a, name)}: expected an integer >= 1")
    if a.hidden % a.heads or (a.hidden // a.heads) % 2:
        raise ValueError(f"--hidden={a.hidden} --heads={a.heads}: expected an even head dim")
    torch.set_num_threads(1)
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rollout.decoders import LeanStepper
    from fastgrpo.native.decode_step import decode_step_module

    if decode_step_module() is None:
        raise SystemExit("the native decode step could not be built here (see the warning above)")
    model, _ = build_tiny_model(a.arch, hidden_size=a.hidden, num_hidden_layers=a.layers,
                                num_attention_heads=a.heads, num_key_value_heads=1, head_dim=a.hidden // a.heads,
                                intermediate_size=2 * a.hidden)
    model.eval()
    bench = Bench("decode_step")
    width = 8
    for rows in a.rows:
        ids = torch.randint(3, 40, (rows, width), generator=torch.Generator().manual_seed(rows))
        mask = torch.ones(rows, width, dtype=torch.long)
        with torch.inference_mode():
            steppers = {}
            for native in (True, False):
                res = model(input_ids=ids, attention_mask=mask, use_cache=True)
                steppers[native] = LeanStepper(model, res.past_key_values, mask, max(a.positions) + 1, native=native)
            assert steppers[True].native is not None and steppers[False].native is None
            nxt = torch.randint(3, 40, (rows,))
            pos = torch.full((rows,), width)
            for p in a.positions:
                slot = p - width
                if slot < 0:
                    continue
                st = time_interleaved({"python": lambda: steppers[False].step(nxt, pos, slot),
                          "native": lambda: steppers[True].step(nxt, pos, slot)}, a.repeats, warmup=20)
                base = st["python"].median_s
                for name, s in st.items():
                    bench.add(case=f"{name} step", shape=f"{a.arch},h{a.hidden}xL{a.layers},rows={rows},positions={p}",
                              stats=s, extra={"us_per_step": round(s.median_s * 1e6, 1),
                                              "speedup": round(base / s.median_s, 2)})
        with torch.inference_mode():
            _sampling_case(bench, steppers[True], nxt, pos, rows, a)
    bench.finish()


def _sampling_case(bench, stepper, nxt, pos, rows, a):
    """One step's sampling and bookkeeping at temperature 0.8 on the step's logits: the engine's
    Python path (pick: inverse CDF on torch ops, then the out_tok / out_lp writes and the stop
    check) vs csrc/jit/decode_step.cpp's sample_step, which does the same in one call."""
    from fastgrpo.rollout.decoders import pick
    from fastgrpo.rollout.torch_engine import process_logits

    logits = stepper.step(nxt, pos, 0)
    T = 32
    u = torch.rand((rows, T), generator=torch.Generator().manual_seed(0))
    r, stop = torch.arange(rows), torch.tensor([1, 2])
    out_tok, out_lp = torch.zeros((rows, T), dtype=torch.long), torch.zeros((rows, T))
    length, stopped = torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.bool)
    alive, tok = torch.ones(rows, dtype=torch.bool), torch.empty(rows, dtype=torch.long)

    def python():
        y, lp = pick(logits, 0.8, 0, 1.0, u[r, 3], process_logits, 3)
        out_tok[r, 3], out_lp[r, 3] = y, lp
        done = torch.isin(y, stop) & alive
        return int(done.sum())

    def native():
        return stepper.native.sample_step(logits, 0.8, u, 3, r, stop, tok, alive, out_tok, out_lp, length, stopped)

    st = time_interleaved({"python": python, "native": native}, a.repeats, warmup=20)
    base = st["python"].median_s
    for name, s in st.items():
        bench.add(case=f"{name} sampling", shape=f"vocab={logits.shape[1]},rows={rows},T=0.8", stats=s,
                  extra={"us_per_step": round(s.median_s * 1e6, 1), "speedup": round(base / s.median_s, 2)})


if __name__ == "__main__":
    main()
