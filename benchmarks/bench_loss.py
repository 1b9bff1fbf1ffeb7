"""Benchmark of the GRPO loss on CPU: fastgrpo's vocabulary-streaming torch path against the
naive `log_softmax(logits.float())` path and TRL's `selective_log_softmax` path, forward +
backward, with the same O(N) objective on top of each (fastgrpo.kernels.objective).

Cases (per shape and dtype):
  fastgrpo          grpo_loss(impl="torch"), gradient into a new buffer
  fastgrpo-inplace  grpo_loss(impl="torch", inplace_backward=True): gradient written into the logits
                    (the logits then hold the gradient; later repeats run on those values, which
                    changes nothing in the work done)
  naive             log_softmax(logits.float() / τ).gather(targets) under autograd
  trl               trl.trainer.utils.selective_log_softmax on the [B, L, V] padded view (its CPU
                    path loops over the B rows: logsumexp for fp32, log_softmax for bf16)
  softcap-kernel    Gemma 2's final-logit cap (--softcap, 30) inside the loss: grpo_loss(impl="torch",
                    LossConfig(softcap=…), inplace_backward=True) on a non-leaf view of the logits,
                    as the trainer hands it the lm_head output (the gradient lands in the logits)
  softcap-torch-op  the cap by torch ops first, cap·tanh(z/cap) (the trainer's former path: tanh's
                    saved output and the capped logits are two more N×V tensors, its backward two
                    more), then the same in-place loss on the capped logits
                    Measured side by side (2-core box, 1 thread, N 4096 × V 49152 fp32, medians of 5):
                    kernel 2.25 s vs torch-op 6.29 s (2.8×; 2.9× in a second run), extra peak RSS
                    26 MiB vs 3072 MiB (4 N×V fp32 tensors); the uncapped loss 1.46 s. bf16: 2.98 s
                    vs 5.54 s (1.9×), 42 MiB vs 1530 MiB (the torch-op path caps in bf16, the kernel
                    in fp32)

Byte floor (comment per house style): the forward must read the logits once and the backward read
them once and write the gradient once, 3·N·V·bytes; `floor_GBps` reports that traffic divided by
the measured time (the CPU's copy bandwidth bounds it). Peak memory is the extra RSS of one
fwd+bwd in a fresh subprocess (harness.peak_rss_subprocess), inputs excluded. The in-kernel cap
keeps that floor (it caps each tile in cache); the torch-op cap adds ≥ 4·N·V·4 bytes of traffic
(write tanh(z/cap) and the capped logits, and in its backward read and write two N×V gradients).

  python -m benchmarks.bench_loss                          # default: a few minutes on 2 cores
  python -m benchmarks.bench_loss --shapes 4096x151936:bf16,4096x151936:fp32,8192x32000:fp32
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.harness import Bench, Stats, _quantile, peak_rss_subprocess, time_fn

CASES = ("fastgrpo", "fastgrpo-inplace", "naive", "trl", "softcap-kernel", "softcap-torch-op")
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping (the default of --softcap)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _inputs(n: int, v: int, dtype: str, seq_len: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.empty(n, v, dtype=DTYPES[dtype])
    rows = max(1, (1 << 22) // max(v, 1))  # filled by row blocks: no N×V float32 transient, which
    for r0 in range(0, n, rows):           # ru_maxrss would remember as part of the measured peak
        logits[r0:r0 + rows] = torch.randn(min(rows, n - r0), v, generator=g) * 2
    logits.requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    adv = torch.randn(n, generator=g)
    old = torch.randn(n, generator=g) * 0.05 - v.bit_length()  # near log(1/V): ratios around 1
    mask = torch.rand(n, generator=g) > 0.1
    cu = torch.arange(0, n + 1, seq_len).clamp(max=n)
    if int(cu[-1]) != n:
        cu = torch.cat([cu, torch.tensor([n])])
    return dict(logits=logits, targets=targets, adv=adv, old=old, mask=mask, cu=cu, seq_len=seq_len)


def _objective(logp, p):
    from fastgrpo.kernels.contract import LossConfig
    from fastgrpo.kernels.objective import objective_loss, prepare_objective

    cfg = LossConfig(eps_high=0.28)
    inp = prepare_objective(logp.shape[0], logp.device, logp.dtype, p["adv"], p["mask"], p["old"], None, None,
                            p["cu"], cfg, None)
    return objective_loss(logp, None, inp, cfg)[0]


def step(case: str, p) -> float:
    """One forward + backward of `case` on prepared inputs `p`; returns the loss value."""
    logits, targets = p["logits"], p["targets"]
    if case.startswith("softcap"):
        from fastgrpo.loss import LossConfig, grpo_loss

        cap = p.get("softcap", SOFTCAP)
        if case == "softcap-kernel":
            z, cfg = logits.view_as(logits), LossConfig(eps_high=0.28, softcap=cap)  # a non-leaf: in place
        else:
            z, cfg = torch.tanh(logits / cap) * cap, LossConfig(eps_high=0.28)
        loss = grpo_loss(z, targets, p["adv"], mask=p["mask"], old_logp=p["old"], cu_seqlens=p["cu"], config=cfg,
                         impl="torch", inplace_backward=True).loss
    elif case.startswith("fastgrpo"):
        from fastgrpo.loss import LossConfig, grpo_loss

        out = grpo_loss(logits, targets, p["adv"], mask=p["mask"], old_logp=p["old"], cu_seqlens=p["cu"],
                        config=LossConfig(eps_high=0.28), impl="torch",
                        inplace_backward=case == "fastgrpo-inplace")
        loss = out.loss
    elif case == "naive":
        logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        loss = _objective(logp, p)
    elif case == "trl":
        from trl.trainer.utils import selective_log_softmax

        n, v = logits.shape
        L = p["seq_len"]
        pad = (-n) % L  # TRL works on a padded [B, L, V] batch
        x = logits if pad == 0 else torch.cat([logits, logits.new_zeros(pad, v)])
        y = targets if pad == 0 else torch.cat([targets, targets.new_zeros(pad)])
        logp = selective_log_softmax(x.view(-1, L, v), y.view(-1, L)).reshape(-1)[:n].float()
        loss = _objective(logp, p)
    else:
        raise ValueError(f"case={case!r}: expected one of {CASES}")
    # autograd.grad hands back ∂loss/∂logits as the lm_head backward would receive it; .backward()
    # on a leaf would add AccumulateGrad's copy of an aliased (in-place) gradient
    (grad,) = torch.autograd.grad(loss, logits)
    del grad
    return float(loss.detach())


def measure(case: str, n: int, v: int, dtype: str, seq_len: int, threads: int, prepare: bool = False,
            prepared=None, softcap: float = SOFTCAP):
    """Entry point of harness.peak_rss_subprocess."""
    torch.set_num_threads(threads)
    if prepare:
        # import every backend and run each case once on a tiny input, so that module imports and
        # one-off allocator / thread-pool growth are not counted as the case's peak
        import fastgrpo.loss  # noqa: F401
        if case == "trl":
            import trl.trainer.utils  # noqa: F401

        step(case, _inputs(8, 64, dtype, 4))
        return dict(_inputs(n, v, dtype, seq_len), softcap=softcap)
    return step(case, prepared)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1024x32000:fp32,1024x151936:bf16",
                    help="comma list of NxV:dtype (dtype bf16|fp32)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seq-len", type=int, default=512, help="sequence length of the padded TRL view")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    # 1 thread by default: on the shared 2-core dev box an oversubscribed OpenMP pool turns every
    # parallel op's barrier into a wait on a descheduled thread (measured 50x swings at 2 threads)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--softcap", type=float, default=SOFTCAP, help="the cap of the softcap-* cases")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = Bench("loss")
    for spec in args.shapes.split(","):
        nv, dtype = spec.split(":")
        n, v = (int(s) for s in nv.lower().split("x"))
        if dtype not in DTYPES:
            raise ValueError(f"--shapes: dtype {dtype!r} in {spec!r}: expected one of {tuple(DTYPES)}")
        shape = f"N={n},V={v},{dtype},{args.threads}thr"
        p = dict(_inputs(n, v, dtype, args.seq_len), softcap=args.softcap)
        cases = args.cases.split(",")
        # round-robin repeats: on a shared machine the load drifts over minutes, and interleaving
        # the cases makes every case see the same drift, so the ratios stay meaningful
        samples = {c: [] for c in cases}
        for case in cases:
            step(case, p)  # warm-up
        for _ in range(args.repeats):
            for case in cases:
                samples[case] += time_fn(lambda: step(case, p), repeats=1, warmup=0).samples
        nbytes = 3 * n * v * p["logits"].element_size()
        del p  # free the timing inputs before the memory children allocate their own
        results = {}
        for case in cases:
            xs = samples[case]
            st = Stats(statistics.median(xs), _quantile(xs, 0.2), _quantile(xs, 0.8), xs)
            mem = None if args.no_memory else peak_rss_subprocess(
                "benchmarks.bench_loss", "measure", dict(case=case, n=n, v=v, dtype=dtype, seq_len=args.seq_len,
                                                       threads=args.threads, softcap=args.softcap))
            results[case] = (st, mem)
            print(f"{shape} {case}: {st.median_s * 1e3:.1f} ms, peak {mem} MiB", file=sys.stderr, flush=True)
        base_t, base_m = results.get("trl", (None, None))
        op_t, op_m = results.get("softcap-torch-op", (None, None))
        for case, (st, mem) in results.items():
            extra = {"floor_GBps": nbytes / st.median_s / 1e9}
            if case.startswith("softcap"):  # the cap's two paths against each other, not against TRL
                if op_t is not None:
                    extra["speedup_vs_torch_op"] = op_t.median_s / st.median_s
                    if mem is not None and op_m:
                        extra["mem_vs_torch_op"] = mem / op_m
            elif base_t is not None:
                extra["speedup_vs_trl"] = base_t.median_s / st.median_s
                if mem is not None and base_m:
                    extra["mem_vs_trl"] = mem / base_m
            bench.add(case=case, shape=shape, stats=st, peak_mb=mem, extra=extra)
    bench.finish()


if __name__ == "__main__":
    main()
