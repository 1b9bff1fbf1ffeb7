"""The async weight broadcast, trainer rank 0 → one rollout worker on the same machine, by
transport (sync.transport): SmolLM2-135M's parameters (float32, 538 MB, random values of its
shapes), the trainer process pinned to one core and the receiver to the other, as bench_async
places them.

Cases, run in turn inside each repeat (the same machine load; medians of --repeats):
  group, fresh buffers   the gloo group, the receiver allocating new buffers every sync (before
                         2026-12-03: fresh pages, faulted in by the first write)
  group                  the gloo group, the receiver's buffers reused (StagingBuffers)
  shm                    rank 0 packs into its shared-memory segment, the receiver copies out
                         into reused buffers (sync.transport=auto on one node)
Each: wall seconds from the send to the receiver's checksums (what the trainer's broadcast thread
waits), the CPU seconds each process spent (`time.process_time`: the share of its core a sync
takes from the update or from generation), and the receiver's checksums compared with the
trainer's (a wrong byte fails the run).

    python -m benchmarks.bench_broadcast                # SmolLM2-135M shapes, 7 repeats
    python -m benchmarks.bench_broadcast --smoke        # a tiny model, 2 repeats: proves it runs

Appends to benchmarks/results/broadcast.csv (harness.Bench).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CASES = ("group, fresh buffers", "group", "shm")


def named_weights(smoke: bool):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    else:  # SmolLM2-135M's architecture
        cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    torch.manual_seed(0)
    return [(n, p.detach()) for n, p in LlamaForCausalLM(cfg).named_parameters()]


def _pin(core: int) -> None:
    import torch

    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > core:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


def receiver(port: int, inbox, outbox, core: int) -> None:
    """The worker's side: receive each case's sync as RolloutWorker.receive_weights does."""
    import torch

    from fastgrpo.sync import broadcast as bc

    _pin(core)
    group = bc.BroadcastGroup("127.0.0.1", port, 1, 2, 120)
    plan = inbox.get()
    shm, staging = bc.ShmReceiver(track=True), bc.StagingBuffers()
    while True:
        msg = inbox.get()
        if msg is None:
            break
        case, payload = msg
        bufs = []

        def alloc(n, device):
            bufs.append(staging.take(n, device) if case != "group, fresh buffers"
                        else torch.empty(n, dtype=torch.uint8, device=device))
            return bufs[-1]

        c0 = time.process_time()
        named = shm.receive(payload, plan, alloc=alloc) if case == "shm" else bc.receive(group, plan, alloc=alloc)
        sums = bc.checksums(named.items())
        cpu = time.process_time() - c0
        del named
        staging.give(bufs if case != "group, fresh buffers" else [])
        outbox.put((cpu, sums))
    shm.close()


def measure(smoke: bool, repeats: int, bucket_mb: int):
    """{case: {"wall": [...], "trainer_cpu": [...], "worker_cpu": [...]}}, payload bytes."""
    from fastgrpo.sync import broadcast as bc
    from fastgrpo.sync.shm import ShmTransport

    _pin(0)
    named = named_weights(smoke)
    store, port = bc.BroadcastGroup.serve("127.0.0.1", 2, 120)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(port, inbox, outbox, 1), daemon=True)
    proc.start()
    group = bc.BroadcastGroup("127.0.0.1", port, 0, 2, 120, store=store)
    plan = bc.plan(named, bucket_mb << 20)
    inbox.put(plan)
    channel = ShmTransport(n_buffers=1)
    out = {c: {"wall": [], "trainer_cpu": [], "worker_cpu": []} for c in CASES}
    try:
        for rep in range(repeats + 1):  # the first round warms up (first pages, first connections)
            for case in CASES:
                t0, c0 = time.perf_counter(), time.process_time()
                if case == "shm":
                    inbox.put((case, bc.send_shm(channel, named, plan)))
                else:
                    inbox.put((case, None))
                    bc.send(group, named, plan)
                expected = bc.checksums(named)
                cpu, sums = outbox.get(timeout=300)
                wall, tcpu = time.perf_counter() - t0, time.process_time() - c0
                bc.verify(expected, sums, f"bench receiver ({case})", 0, 0)
                if rep:
                    out[case]["wall"].append(wall)
                    out[case]["trainer_cpu"].append(tcpu)
                    out[case]["worker_cpu"].append(cpu)
    finally:
        inbox.put(None)
        proc.join(timeout=60)
        channel.close()
    return out, sum(t.numel() * t.element_size() for _, t in named)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bucket-mb", type=int, default=256, help="sync.bucket_mb")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 2 repeats")
    ap.add_argument("--csv", help="CSV to append to (default benchmarks/results/broadcast.csv)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.repeats = 2
    from benchmarks.harness import Bench, Stats, _quantile

    out, nbytes = measure(a.smoke, a.repeats, a.bucket_mb)
    bench = Bench("broadcast")
    shape = f"{nbytes / 1e6:.0f} MB fp32, bucket {a.bucket_mb} MiB, 1 receiver"
    base = statistics.median(out["group, fresh buffers"]["trainer_cpu"]) + statistics.median(
        out["group, fresh buffers"]["worker_cpu"])
    for case in CASES:
        w = out[case]["wall"]
        tc, wc = statistics.median(out[case]["trainer_cpu"]), statistics.median(out[case]["worker_cpu"])
        bench.add(case=case, shape=shape, stats=Stats(statistics.median(w), _quantile(w, 0.2), _quantile(w, 0.8), w),
                  extra={"trainer_cpu_s": tc, "worker_cpu_s": wc, "cpu_x_vs_before": base / max(tc + wc, 1e-9)})
    bench.finish(a.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
