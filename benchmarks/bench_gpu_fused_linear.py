"""GPU benchmark of `fused_linear_grpo_loss` (lm_head + GRPO loss without [N, V] logits) vs the
bare lm_head matmuls, Liger-Kernel's `LigerFusedLinearGRPOLoss` and TRL 1.16's chunked lm_head
log-prob path (`trl.kernels.ChunkedLogProbFunction` + the loss in torch), side by side.

FLOP formula: forward logits 2·N·H·V, backward dH and dW 2·(2·N·H·V): the bare matmuls do
6·N·H·V FLOPs with the [N, V] logits and their gradient in memory; our token-level path does
the same GEMMs (gradient made during the forward); the sequence-level ratio recomputes the
logits once more (8·N·H·V). `vs_matmuls` = time / bare-matmul time (target ≤ 1.25).

    python benchmarks/bench_gpu_fused_linear.py                # H=4096, V=151936, N=4k,16k, bf16
    python benchmarks/bench_gpu_fused_linear.py --cpu-smoke    # every path on CPU, tiny sizes
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_common import (  # noqa: E402
    bench_ms, bootstrap, oracle_check, parse_sizes, peak_mb, sequence_layout, try_import)

SEQ_LEN = 1024  # Liger takes [B, T, H] hidden states: N tokens as B = N / T sequences


def make_inputs(n, h, v, dtype, device, seed=0):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)  # on the device: no multi-GB host tensors
    hidden = torch.randn(n, h, generator=g, device=device, dtype=dtype)
    weight = torch.randn(v, h, generator=g, device=device, dtype=dtype).mul_(2 / h ** 0.5)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    lay = sequence_layout(n, g, device, SEQ_LEN)
    with torch.no_grad():  # old / ref near the current policy, chunked so no [N, V] is kept
        logp = torch.cat([torch.log_softmax((hidden[i:i + 2048] @ weight.t()).float(), -1)
                          .gather(1, targets[i:i + 2048, None]).squeeze(1) for i in range(0, n, 2048)])
    old = logp + 0.1 * torch.randn(n, generator=g, device=device)
    ref = logp + 0.1 * torch.randn(n, generator=g, device=device)
    return dict(hidden=hidden, weight=weight, targets=targets, old=old, ref=ref, **lay)


def config(level="token"):
    from fastgrpo.kernels.contract import LossConfig

    return LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl="k3", loss_agg="token-mean", ratio_level=level)


def ours(inp, level="token", chunk_size=None, impl="triton"):
    """impl "triton": the chunked path (chunk logits through memory); "cce": the single kernel."""
    from fastgrpo.loss import fused_linear_grpo_loss

    return fused_linear_grpo_loss(inp["hidden"], inp["weight"], inp["targets"], inp["adv"], mask=inp["mask"],
                                  old_logp=inp["old"], ref_logp=inp["ref"], cu_seqlens=inp["cu"],
                                  config=config(level), impl=impl, chunk_size=chunk_size).loss


def bare_matmuls(inp, grad):
    logits = inp["hidden"] @ inp["weight"].t()
    logits.backward(grad)


def trl_chunked(inp, fn, vocab_chunk):
    """TRL's fused lm_head log-probs, then TRL's bnpo loss on [N] in torch."""
    import torch

    cfg = config()
    logp = fn(inp["hidden"], inp["weight"], None, inp["targets"], 1.0, vocab_chunk, None, 1.0, ())[0]
    coef_1 = torch.exp(logp - inp["old"])
    coef_2 = torch.clamp(coef_1, 1 - cfg.eps_low, 1 + cfg.eps_high)
    per_tok = -torch.min(coef_1 * inp["adv"], coef_2 * inp["adv"])
    d = inp["ref"] - logp
    per_tok = per_tok + cfg.beta * (torch.exp(d) - d - 1)
    return (per_tok * inp["mask"]).sum() / inp["mask"].sum().clamp(min=1.0)


def liger_fused(inp, module):
    b, t = inp["b"], inp["t"]
    h = inp["hidden"][: b * t].view(b, t, -1)
    shape = lambda x: x[: b * t].view(b, t)  # noqa: E731
    loss, _ = module(h, inp["weight"], shape(inp["targets"]), shape(inp["mask"]), inp["adv_seq"],
                     ref_per_token_logps=shape(inp["ref"]), old_per_token_logps=shape(inp["old"]))
    return loss


def check(device, dtype, cpu_smoke):
    """Gradients of hidden and weight vs the float64 oracle on materialised logits."""
    import torch

    from fastgrpo.kernels.reference import grpo_loss_reference

    n, h, v = (50, 16, 300) if cpu_smoke else (2048, 1024, 32768)
    lines = []
    for level in ("token", "sequence"):
        inp = make_inputs(n, h, v, dtype, device, seed=1)
        res = {}
        for name, dt in (("truth", torch.float64), ("ref", dtype), ("kern", dtype), ("cce", dtype)):
            hid = inp["hidden"].to(dt).clone().requires_grad_(True)
            w = inp["weight"].to(dt).clone().requires_grad_(True)
            if name in ("kern", "cce"):
                loss = ours(dict(inp, hidden=hid, weight=w), level, chunk_size=max(n // 3, 1),
                            impl="triton" if name == "kern" else "cce")
            else:
                loss = grpo_loss_reference(hid @ w.t(), inp["targets"], inp["adv"].to(dt), mask=inp["mask"],
                                           old_logp=inp["old"], ref_logp=inp["ref"], cu_seqlens=inp["cu"],
                                           config=config(level)).loss
            loss.backward()
            res[name] = (loss, hid.grad, w.grad)
        atol, rtol = (1e-3, 8e-3) if dtype != torch.float32 else (2e-6, 2e-5)
        for kern, tag in (("kern", "fused"), ("cce", "cce")):
            for i, what in enumerate(("loss", "d_hidden", "d_weight")):
                lines.append(f"{tag} {level} N={n} H={h} V={v}: " + oracle_check(
                    what, res[kern][i], res["ref"][i], res["truth"][i], atol, rtol))
        del res, inp
        gc.collect()
    return lines


def run_bench(ns, h, vs, dtype, device, bench, liger_compile):
    import torch

    trl_fn = try_import("trl.kernels", "ChunkedLogProbFunction")
    trl_chunk = 4096
    if trl_fn is not None:
        import trl.trainer.utils as tu

        trl_chunk = getattr(tu, "_CHUNKED_LOGPROB_CHUNK_SIZE", trl_chunk)
    liger_cls = try_import("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss")
    for n in ns:
        for v in vs:
            shape = f"N={n},H={h},V={v},{str(dtype).replace('torch.', '')}"
            flops = 6 * n * h * v
            inp = make_inputs(n, h, v, dtype, device)
            leaves = [inp["hidden"].requires_grad_(True), inp["weight"].requires_grad_(True)]
            grad = torch.randn(n, v, device=device, dtype=dtype) * 1e-3
            rows = []

            def case(name, fn):
                stats = bench_ms(fn, device, grad_to_none=leaves)
                mem = peak_mb(fn, device, grad_to_none=leaves)
                rows.append((name, stats, mem))

            case("bare matmuls (logits + dH + dW)", lambda: bare_matmuls(inp, grad))
            del grad
            gc.collect()
            case("fastgrpo fused token-ratio", lambda: ours(inp).backward())
            case("fastgrpo fused sequence-ratio", lambda: ours(inp, "sequence").backward())
            case("fastgrpo cce single kernel token-ratio", lambda: ours(inp, impl="cce").backward())
            if trl_fn is not None:
                case(f"trl chunked logprob (vocab chunk {trl_chunk})",
                     lambda: trl_chunked(inp, trl_fn.apply, trl_chunk).backward())
            if liger_cls is not None:
                module = liger_cls(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="bnpo",
                                   temperature=1.0, compiled=liger_compile, use_ref_model=True)
                case("liger fused linear grpo" + ("" if liger_compile else " (eager)"),
                     lambda: liger_fused(inp, module).backward())
            base = rows[0][1].median_s
            for name, stats, mem in rows:
                bench.add(case=name + " fwd+bwd", shape=shape, stats=stats, peak_mb=mem,
                          extra={"TFLOP/s": round(flops / stats.median_s / 1e12, 2),
                                 "vs_matmuls": round(stats.median_s / base, 3)})
            del inp, leaves
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", default=None, help="token counts (default 4096,16384; smoke 96)")
    p.add_argument("--vs", default=None, help="vocabulary sizes (default 151936; smoke 333)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (default 4096; smoke 32)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--liger-compile", action="store_true", help="let Liger torch.compile its chunk (slow start)")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny sizes")
    p.add_argument("--csv", default=None, help="CSV file to append to (default benchmarks/results/<name>.csv)")
    args = p.parse_args(argv)
    bootstrap(args.cpu_smoke)
    import torch

    from benchmarks.harness import Bench

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.cpu_smoke:
        device = torch.device("cpu")
        defaults = ("96", "333", 32)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu_fused_linear: no CUDA device; use --cpu-smoke to exercise it on CPU")
        device = torch.device("cuda")
        defaults = ("4096,16384", "151936", 4096)
    ns = parse_sizes(args.ns or defaults[0])
    vs = parse_sizes(args.vs or defaults[1])
    h = args.hidden or defaults[2]
    if not args.no_check:
        for line in check(device, dtype, args.cpu_smoke):
            print(line)
    bench = Bench("gpu_fused_linear" + ("_cpu_smoke" if args.cpu_smoke else ""))
    run_bench(ns, h, vs, dtype, device, bench, args.liger_compile)
    return bench.finish(args.csv)


if __name__ == "__main__":
    main()
