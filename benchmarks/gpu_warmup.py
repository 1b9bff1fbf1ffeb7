"""Warm-up step of the GPU suite: tune, cache and compile the kernel configs the later steps use,
timed, so that the oracle check and the timings compile nothing and tune nothing.

The kernels' config choice (kernels/triton/_tune.py) is keyed by (kernel, device, dtypes, flags,
V bucket, row layout, N bucket) and cached on disk; a key's first launch tunes on a scratch slice
of at most 256 MiB of logits. So one launch per key at the smallest N of its bucket does the
whole job: the logits tensor is `torch.empty` (values do not change the timings) and its size is
N·V·b bytes (2.5 GB at 16 385 × 151 936 bf16, the largest here). Each line prints the key's
seconds and the config chosen; the last line the total, also when a key fails.

    python benchmarks/gpu_warmup.py              # on the GPU machine
    python benchmarks/gpu_warmup.py --cpu-smoke  # the same calls on CPU under TRITON_INTERPRET=1
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_common import bootstrap  # noqa: E402

# (N, V, dtype, entropy in the forward): what bench_gpu_kernels.py (oracle check: 4096 × 151 936
# and 70 001 × 4096 with entropy, bf16 + fp32; timings: {4k, 16k, 64k} × {32k, 128k, 152k} bf16)
# and bench_gpu_fused_linear.py (chunks of 3456 × 151 936 bf16) launch. N = 16 385 stands for
# every N above 16 384 (one bucket).
SUITE = [(4096, 151_936, "bf16", True), (4096, 151_936, "fp32", True),
         (16_385, 4096, "bf16", True), (16_385, 4096, "fp32", True)]
SUITE += [(n, v, "bf16", False) for n in (4096, 16_385) for v in (32_768, 131_072, 151_936)]
SUITE += [(3456, 151_936, "bf16", False)]
SMOKE = [(40, 300, "bf16", True), (70, 5, "fp32", False), (96, 333, "bf16", False)]
# impl="cce" (fixed tiles, compiled on first use): (N, H, V, dtype) of bench_gpu_fused_linear.py's
# check and timings; N = 64 has the divisibility of theirs, so the same binaries are built.
CCE = [(64, 1024, 32_768, "bf16"), (64, 4096, 151_936, "bf16")]
CCE_SMOKE = [(48, 16, 100, "bf16")]


def warm(n, v, dtype, ent, device):
    import torch

    from fastgrpo.kernels.triton.grpo_loss import grpo_loss_bwd
    from fastgrpo.kernels.triton.logprobs import token_logprobs_fwd

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    logits = torch.empty(n, v, dtype=dt, device=device)
    if device.type == "cpu":
        logits.normal_()
    targets = torch.randint(0, v, (n,), device=device)
    _, lse, _ = token_logprobs_fwd(logits, targets, 1.0, ent)
    g = torch.full_like(lse, 1e-3)
    grpo_loss_bwd(logits, targets, lse, g, None, None, 1.0, out=logits)
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_cce(n, hdim, v, dtype, device):
    import torch

    from fastgrpo.loss import fused_linear_grpo_loss

    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    hid = (torch.randn(n, hdim, device=device) * 0.1).to(dt).requires_grad_(True)
    w = (torch.randn(v, hdim, device=device) * 0.02).to(dt).requires_grad_(True)
    targets = torch.randint(0, v, (n,), device=device)
    fused_linear_grpo_loss(hid, w, targets, torch.randn(n, device=device), impl="cce").loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny sizes")
    args = p.parse_args(argv)
    bootstrap(args.cpu_smoke)
    import torch

    from fastgrpo.kernels.triton import _tune

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("gpu_warmup: no CUDA device; use --cpu-smoke to exercise the script on CPU")
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    print(f"warm-up: tuning cache {_tune.cache_path()}")
    t0 = time.perf_counter()
    failed = 0
    for n, v, dtype, ent in SMOKE if args.cpu_smoke else SUITE:
        t = time.perf_counter()
        try:
            warm(n, v, dtype, ent, device)
            print(f"warm-up N={n} V={v} {dtype} entropy={int(ent)}: {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as e:  # one line per key even when it fails; the suite goes on
            failed += 1
            print(f"warm-up N={n} V={v} {dtype} entropy={int(ent)}: FAILED after {time.perf_counter() - t:.1f} s: "
                  f"{type(e).__name__}: {str(e)[:300]}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for n, hdim, v, dtype in CCE_SMOKE if args.cpu_smoke else CCE:
        t = time.perf_counter()
        try:
            warm_cce(n, hdim, v, dtype, device)
            print(f"warm-up cce N={n} H={hdim} V={v} {dtype}: {time.perf_counter() - t:.1f} s", flush=True)
        except Exception as e:
            failed += 1
            print(f"warm-up cce N={n} H={hdim} V={v} {dtype}: FAILED after {time.perf_counter() - t:.1f} s: "
                  f"{type(e).__name__}: {str(e)[:300]}", flush=True)
    from fastgrpo.kernels.triton.grpo_loss import GRPO_LOSS_BWD
    from fastgrpo.kernels.triton.logprobs import TOKEN_LOGPROBS_FWD

    for tk in (TOKEN_LOGPROBS_FWD, GRPO_LOSS_BWD):
        for key, cfg in tk.chosen.items():
            print(f"warm-up chose {cfg.as_tuple()} (BN, BV, warps, stages) for {key}")
    print(f"warm-up: {time.perf_counter() - t0:.1f} s in all, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
