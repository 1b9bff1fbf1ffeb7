"""float32 CPU linears: PyTorch's default (`F.linear`, MKL sgemm) vs fastgrpo.models.onednn (oneDNN),
side by side (the two alternate within each repeat), medians.

Cases: the three products of a linear layer (forward, input gradient, weight gradient) at the
demo model's packed-update shapes and at a decode-step shape (below `MIN_ROWS`, where the
default stays), then the tiny model's packed forward + backward with its linears swapped or not.

    python -m benchmarks.bench_cpu_gemm --threads 1
"""
from __future__ import annotations

import argparse
import torch
import torch.nn.functional as F

from benchmarks.harness import Bench, time_interleaved


def _products(bench, rows, k, n, repeats):
    # FLOPs of each product: 2·rows·k·n (one multiply-add per output element per k); reported
    # as GFLOP/s, against ~105 (MKL's AVX2 path) and ~220 (oneDNN's AVX-512) at best on one core
    # of the CI machine (a 1024³ product: 109 / 230 GFLOP/s)
    from fastgrpo.models.onednn import _mm

    gen = torch.Generator().manual_seed(0)
    x, w, g = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(rows, n, generator=gen)
    cases = {
        "forward": ({"default": lambda: F.linear(x, w), "oneDNN": lambda: _mm(x, w)}),
        "input grad": ({"default": lambda: g @ w, "oneDNN": lambda: _mm(g, w.t())}),
        "weight grad": ({"default": lambda: g.t() @ x, "oneDNN": lambda: _mm(g.t(), x.t())}),
    }
    for what, fns in cases.items():
        st = time_interleaved(fns, repeats)
        base = st["default"].median_s
        for name, s in st.items():
            bench.add(case=f"{what}: {name}", shape=f"[{rows},{k}]x[{k},{n}]", stats=s,
                      extra={"GFLOP/s": round(2 * rows * k * n / s.median_s / 1e9, 1),
                             "speedup": round(base / s.median_s, 2)})


def _model(bench, repeats, completions, seed=0):
    import copy

    from fastgrpo.models.onednn import use_onednn_linears
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.models.packed import packed_hidden_states
    from fastgrpo.packing import build_packed_batches

    model, _ = build_tiny_model("qwen2", seed=seed, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    fast = copy.deepcopy(model)
    if use_onednn_linears(fast) == 0:
        print("[bench_cpu_gemm] oneDNN is not enabled on this machine (FASTGRPO_CPU_GEMM / CPU): model case skipped")
        return
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (int(torch.randint(12, 24, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(8)]
    seqs = [(p, torch.randint(3, 40, (int(torch.randint(4, completions, (1,), generator=gen)),), generator=gen).tolist())
            for p in prompts for _ in range(8)]
    batch = build_packed_batches([p for p, _ in seqs], [c for _, c in seqs], [0.0] * len(seqs), 10 ** 6)[0]

    def step(m):
        def f():
            m.zero_grad(set_to_none=True)
            packed_hidden_states(m, batch).square().mean().backward()
        return f

    st = time_interleaved({"default": step(model), "oneDNN": step(fast)}, repeats)
    base = st["default"].median_s
    for name, s in st.items():
        bench.add(case=f"tiny model fwd+bwd: {name}", shape=f"T={batch.input_ids.numel()}", stats=s,
                  extra={"speedup": round(base / s.median_s, 2)})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args(argv)
    if a.repeats < 1:
        raise ValueError(f"--repeats={a.repeats}: expected an integer >= 1")
    if a.threads:
        torch.set_num_threads(a.threads)
    from fastgrpo.models.onednn import onednn_enabled

    print(f"[bench_cpu_gemm] CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN linears enabled: {onednn_enabled()}")
    bench = Bench("cpu_gemm")
    for rows, k, n in [(1726, 64, 128), (1726, 128, 64), (4096, 896, 896), (64, 64, 128)]:
        _products(bench, rows, k, n, a.repeats)
    for cap in (32, 128):
        _model(bench, a.repeats, cap)
    bench.finish()


if __name__ == "__main__":
    main()
