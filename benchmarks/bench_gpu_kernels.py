"""GPU benchmark of the fused GRPO loss on packed logits [N, V] (bf16): fastgrpo's Triton kernels
vs Liger-Kernel's `triton_grpo_loss` and TRL's path (`selective_log_softmax` + the loss in
torch), forward, forward+backward and backward (= both − forward), side by side in one run.

Byte formula (the floor): forward reads the logits once (N·V·b bytes), backward reads them and
writes the gradient (2·N·V·b), both = 3·N·V·b, b = bytes per element. The floor time is those
bytes at the copy bandwidth measured in the same run; `floor_frac` = floor time / measured time.
The "kernel" rows time our two kernels alone (no O(N) torch objective, no checks) to separate
the kernels' bandwidth from launch overhead of the [N]-vector objective.

    python benchmarks/bench_gpu_kernels.py                   # full table on a GPU
    python benchmarks/bench_gpu_kernels.py --check-only      # compiled kernels vs the oracle
    python benchmarks/bench_gpu_kernels.py --cpu-smoke       # every path on CPU, interpreter, tiny
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_common import (  # noqa: E402
    bench_ms, bootstrap, copy_bandwidth_gbs, oracle_check, parse_sizes, peak_mb, sequence_layout, try_import)

SEQ_LEN = 1024  # Liger takes [B, L+1, V] logits: N tokens as B = N / L sequences of L


def make_inputs(n, v, dtype, device, seed=0):
    import torch

    # Generated on the device in the target dtype: a 64k × 152k fp32 tensor made on the host
    # would take 40 GB of host memory and most of the suite's time budget.
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n, v, generator=g, dtype=dtype, device=device).mul_(2)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    lay = sequence_layout(n, g, device, SEQ_LEN)
    # old / ref policies near the current one, as in training (far-off values make k3 explode).
    true_logp = _logp_rows(logits, targets)
    old = true_logp + 0.1 * torch.randn(n, generator=g, device=device)
    ref = true_logp + 0.1 * torch.randn(n, generator=g, device=device)
    return dict(logits=logits, targets=targets, old=old, ref=ref, **lay)


def _logp_rows(logits, targets, rows=4096):
    import torch

    return torch.cat([torch.log_softmax(logits[i:i + rows].float(), -1).gather(1, targets[i:i + rows, None]).squeeze(1)
                      for i in range(0, logits.shape[0], rows)])


def config():
    from fastgrpo.kernels.contract import LossConfig

    # The setting all three implementations share: DAPO clip-higher, k3 KL, token-mean.
    return LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl="k3", loss_agg="token-mean")


def ours(inp, inplace=False):
    from fastgrpo.loss import grpo_loss

    logits = inp["logits"]
    if inplace:  # in place applies to activations, not leaves: a view stands for the lm_head output
        logits = logits.view_as(logits)
    out = grpo_loss(logits, inp["targets"], inp["adv"], mask=inp["mask"], old_logp=inp["old"],
                    ref_logp=inp["ref"], cu_seqlens=inp["cu"], config=config(), impl="triton",
                    inplace_backward=inplace)
    return out.loss


def trl_path(inp):
    """TRL GRPOTrainer's loss for loss_type='bnpo': selective_log_softmax, then torch on [N]."""
    import torch
    from trl.trainer.utils import selective_log_softmax

    cfg = config()
    logp = selective_log_softmax(inp["logits"], inp["targets"])
    coef_1 = torch.exp(logp - inp["old"])
    coef_2 = torch.clamp(coef_1, 1 - cfg.eps_low, 1 + cfg.eps_high)
    per_tok = -torch.min(coef_1 * inp["adv"], coef_2 * inp["adv"])
    d = inp["ref"] - logp
    per_tok = per_tok + cfg.beta * (torch.exp(d) - d - 1)
    return (per_tok * inp["mask"]).sum() / inp["mask"].sum().clamp(min=1.0)


def liger_inputs(inp):
    """Liger's layout: logits [B, L+1, V] (the last position is dropped), per-sequence advantages."""
    import torch

    b, l = inp["b"], inp["t"]
    n, v = inp["logits"].shape
    x = torch.empty(b, l + 1, v, dtype=inp["logits"].dtype, device=inp["logits"].device)
    x[:, :l] = inp["logits"][: b * l].view(b, l, v)
    x[:, l] = 0
    shape = lambda t: t[: b * l].view(b, l)  # noqa: E731
    return dict(logits=x, ids=shape(inp["targets"]), old=shape(inp["old"]), ref=shape(inp["ref"]),
                mask=shape(inp["mask"]), adv=inp["adv_seq"])


def liger_path(fn, li, inplace=False):
    cfg = config()
    loss, _ = fn(li["logits"], li["old"], li["ref"], li["ids"], li["adv"], li["mask"], temperature=1.0,
                 beta=cfg.beta, eps_low=cfg.eps_low, eps_high=cfg.eps_high, inplace=inplace, loss_type="bnpo",
                 reduce=True)
    return loss


def check(device, dtype, cpu_smoke):
    """Compiled kernels vs the float64 oracle at real sizes; returns the verdict lines."""
    import torch

    from fastgrpo.kernels.reference import grpo_loss_reference

    lines = []
    shapes = [(40, 300), (70_001, 5)] if cpu_smoke else [(4096, 151_936), (70_001, 4096)]
    # (atol, rtol) beyond the same-dtype reference's error: tests/kernels/kernel_oracle.py's TOL
    tol = {torch.bfloat16: (1e-3, 8e-3), torch.float16: (2e-4, 2e-3), torch.float32: (2e-6, 2e-5)}
    for n, v in shapes:
        for dt in (dtype, torch.float32):
            inp = make_inputs(n, v, dt, device, seed=n)
            res = {}
            for name, x in (("truth", inp["logits"].double()), ("ref", inp["logits"]), ("kern", inp["logits"])):
                leaf = x.clone().requires_grad_(True)
                kw = dict(mask=inp["mask"], old_logp=inp["old"], ref_logp=inp["ref"], cu_seqlens=inp["cu"],
                          config=config())
                if name == "kern":
                    from fastgrpo.loss import grpo_loss

                    out = grpo_loss(leaf, inp["targets"], inp["adv"], impl="triton", return_entropy=True, **kw)
                else:
                    out = grpo_loss_reference(leaf, inp["targets"], inp["adv"].to(x.dtype), return_entropy=True, **kw)
                out.loss.backward()
                res[name] = (out, leaf.grad)
                del leaf
            atol, rtol = tol[dt]
            tag = f"N={n} V={v} {str(dt).replace('torch.', '')}"
            for what in ("loss", "logp", "entropy"):
                lines.append(f"{tag} " + oracle_check(what, getattr(res["kern"][0], what), getattr(res["ref"][0], what),
                                                      getattr(res["truth"][0], what), atol, rtol))
            lines.append(f"{tag} " + oracle_check("grad", res["kern"][1], res["ref"][1], res["truth"][1], atol, rtol))
            del res, inp
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return lines


def run_bench(ns, vs, dtype, device, bench):
    import torch

    from fastgrpo.kernels.triton.grpo_loss import grpo_loss_bwd
    from fastgrpo.kernels.triton.logprobs import token_logprobs_fwd

    liger = try_import("liger_kernel.transformers.grpo_loss", "triton_grpo_loss")
    trl_ok = try_import("trl.trainer.utils", "selective_log_softmax") is not None
    bw = copy_bandwidth_gbs(device, 2 ** 30 if device.type == "cuda" else 2 ** 22)
    print(f"copy bandwidth: {bw:.0f} GB/s")
    elt = torch.finfo(dtype).bits // 8
    for n in ns:
        for v in vs:
            shape = f"N={n},V={v},{str(dtype).replace('torch.', '')}"
            nbytes = {"fwd": n * v * elt, "bwd": 2 * n * v * elt, "fwd+bwd": 3 * n * v * elt}

            def add(case, mode, stats, mem=None, label=None):
                floor_s = nbytes[mode] / (bw * 1e9)
                bench.add(case=f"{case} {label or mode}", shape=shape, stats=stats, peak_mb=mem,
                          extra={"GB/s": round(nbytes[mode] / stats.median_s / 1e9, 1),
                                 "floor_frac": round(floor_s / stats.median_s, 3)})

            def measure(case, make, loss_fn, has_inplace):
                # Timing runs out of place (same bytes; an in-place backward would feed gradients
                # back in as logits on the next repeat); peak memory is taken in place, once.
                state = make()
                leaf = state["logits"].requires_grad_(True)
                fwd = bench_ms(lambda: loss_fn(state), device, grad_to_none=[leaf])
                both = bench_ms(lambda: loss_fn(state).backward(), device, grad_to_none=[leaf])
                kw = {"inplace": True} if has_inplace else {}
                mem = peak_mb(lambda: loss_fn(state, **kw).backward(), device, grad_to_none=[leaf])
                add(case, "fwd", fwd)
                add(case, "fwd+bwd", both, mem)
                # Derived row: a difference of medians; quantiles do not subtract, so p20/p80 repeat it.
                d = max(both.median_s - fwd.median_s, 1e-9)
                add(case, "bwd", type(both)(d, d, d, []), label="bwd (fwd+bwd − fwd)")
                del state, leaf
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()

            base = make_inputs(n, v, dtype, device)
            # Kernels alone: the forward kernel, and the backward kernel in place.
            x = base["logits"]
            logp, lse, _ = token_logprobs_fwd(x, base["targets"], 1.0, False)
            g = torch.randn_like(lse) * 1e-3
            add("fastgrpo kernel", "fwd", bench_ms(lambda: token_logprobs_fwd(x, base["targets"], 1.0, False), device))
            add("fastgrpo kernel", "bwd", bench_ms(lambda: grpo_loss_bwd(x, base["targets"], lse, g, None, None, 1.0,
                                                                         out=x), device))
            del x, logp, lse, g
            base["logits"] = None
            gc.collect()
            measure("fastgrpo", lambda: make_inputs(n, v, dtype, device), ours, True)
            if trl_ok:
                measure("trl", lambda: make_inputs(n, v, dtype, device), trl_path, False)
            if liger is not None:
                measure("liger", lambda: liger_inputs(make_inputs(n, v, dtype, device)),
                        lambda li, inplace=False: liger_path(liger, li, inplace), True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", default=None, help="token counts N, comma list, 'k' = ×1024 (default 4k,16k,64k; "
                                              "smoke 256)")
    p.add_argument("--vs", default=None, help="vocabulary sizes V (default 32768,131072,151936; smoke 100,333)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--check-only", action="store_true", help="only the oracle check at real sizes")
    p.add_argument("--no-check", action="store_true", help="skip the oracle check")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU + TRITON_INTERPRET=1 at tiny sizes")
    p.add_argument("--csv", default=None, help="CSV file to append to (default benchmarks/results/<name>.csv)")
    args = p.parse_args(argv)
    bootstrap(args.cpu_smoke)
    import torch

    from benchmarks.harness import Bench

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if args.cpu_smoke:
        device = torch.device("cpu")
        defaults = ("256", "100,333")
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_gpu_kernels: no CUDA device; use --cpu-smoke to exercise the script on CPU")
        device = torch.device("cuda")
        defaults = ("4k,16k,64k", "32768,131072,151936")
    ns, vs = parse_sizes(args.ns or defaults[0]), parse_sizes(args.vs or defaults[1])
    if not args.no_check:
        for line in check(device, dtype, args.cpu_smoke):
            print(line)
    if args.check_only:
        return None
    bench = Bench("gpu_kernels" + ("_cpu_smoke" if args.cpu_smoke else ""))
    run_bench(ns, vs, dtype, device, bench)
    return bench.finish(args.csv)


if __name__ == "__main__":
    main()
