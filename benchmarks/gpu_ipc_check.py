"""Two-process bucket transfer check: bit-exact, with its GB/s.

The trainer process packs named tensors (fp32 → engine dtype, one tensor larger than a bucket so
it is split) into two buffers and sends the engine process their handles once — CUDA IPC handles
with --device cuda, shared-memory names with --device cpu — then, per bucket, only the metadata.
The engine process slices views out of the mapped buffer (fastgrpo.sync.bucket.BucketReceiver),
copies them into its own tensors, synchronises and acknowledges; the trainer packs the next
bucket into the other buffer meanwhile. At the end the engine regenerates the expected tensors
from the same seed and compares bit for bit.

Bytes moved per sync: the payload once through the trainer's pack (read fp32, write dtype) and
once through the engine's copy; GB/s below is payload bytes / wall seconds of one whole sync.

    python benchmarks/gpu_ipc_check.py                       # CUDA, 1 GiB payload, 256 MiB buckets
    python benchmarks/gpu_ipc_check.py --device cpu --mib 64 --bucket-mib 8

Prints one summary line; exits 1 on any mismatch (or with --corrupt, which flips one byte after
packing to prove the check can fail), 2 when the device is unavailable.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastgrpo.sync.bucket import BucketReceiver, bucket_nbytes, named_specs, pack_bucket, plan_buckets  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_tensors(mib: float, bucket_bytes: int, device: str, seed: int):
    """Deterministic fp32 tensors of about `mib` MiB (engine dtype), HF-like names, the embedding
    larger than one bucket so the split path is exercised."""
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = 1024
    target = int(mib * 2**20) // 2           # elements of the payload at 2 bytes
    vocab = max(bucket_bytes // (hidden * 2) + 7, 8)   # > one bucket in bf16
    named = [("model.embed_tokens.weight", (vocab, hidden))]
    layer = 0
    total = vocab * hidden
    while total < target:
        for part, shape in (("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (hidden // 4, hidden)),
                            ("self_attn.v_proj.weight", (hidden // 4, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
                            ("mlp.gate_proj.weight", (3 * hidden, hidden)), ("mlp.up_proj.weight", (3 * hidden, hidden)),
                            ("mlp.down_proj.weight", (hidden, 3 * hidden)), ("input_layernorm.weight", (hidden,))):
            named.append((f"model.layers.{layer}.{part}", shape))
            n = 1
            for s in shape:
                n *= s
            total += n
        layer += 1
    named.append(("model.norm.weight", (hidden,)))
    return [(n, torch.randn(s, generator=g, device=device, dtype=torch.float32)) for n, s in named]


def engine_main(conn, device: str, mib: float, bucket_bytes: int, seed: int, dtype_name: str):
    """The engine process: attach once, load buckets, verify at the end."""
    try:
        payload = conn.recv()
        if payload["kind"] == "shm":
            from fastgrpo.sync import shm

            buffers, keep = shm.attach(payload)
        else:
            from fastgrpo.sync import cuda_ipc

            torch.cuda.set_device(0)
            buffers = cuda_ipc.attach(payload, 0)
        rx = BucketReceiver()
        dst = {}
        while True:
            msg = conn.recv()
            if msg[0] == "bucket":
                _, index, bucket = msg
                for name, t in rx.receive(buffers[index], bucket):
                    if name not in dst:
                        dst[name] = torch.empty_like(t)
                    dst[name].copy_(t)
                if device == "cuda":
                    torch.cuda.synchronize()
                conn.send("ack")
            elif msg[0] == "verify":
                expected = make_tensors(mib, bucket_bytes, device, seed)
                dtype = DTYPES[dtype_name]
                bad = [n for n, t in expected
                       if n not in dst or not torch.equal(_bits(dst[n]), _bits(t.to(dtype)))]
                conn.send(("verified", bad, rx.incomplete()))
                return
    except Exception as e:  # report instead of hanging the trainer
        conn.send(("error", f"{type(e).__name__}: {e}"))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view so that NaN payloads compare bit for bit too."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run(device: str, mib: float, bucket_mib: float, repeats: int, seed: int, dtype_name: str, corrupt: bool) -> int:
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_ipc_check: SKIPPED no CUDA device (use --device cpu for the shared-memory twin)")
        return 2
    bucket_bytes = int(bucket_mib * 2**20)
    dtype = DTYPES[dtype_name]
    named = make_tensors(mib, bucket_bytes, device, seed)
    plan = plan_buckets(named_specs(named, dtype), bucket_bytes)
    tensors = dict(named)
    if device == "cuda":
        from fastgrpo.sync.cuda_ipc import CudaIpcTransport

        transport = CudaIpcTransport("cuda:0")
    else:
        from fastgrpo.sync.shm import ShmTransport

        transport = ShmTransport()
    transport.ensure(max(bucket_nbytes(b) for b in plan))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine_main, args=(child, device, mib, bucket_bytes, seed, dtype_name))
    proc.start()
    parent.send(transport.payload())
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    bufs = transport.buffers
    times = []
    try:
        for rep in range(repeats + 1):           # the first sync is warm-up (page faults, IPC open)
            t0 = time.perf_counter()
            pack_bucket(bufs[0], plan[0], tensors)
            sync()
            for k in range(len(plan)):
                if corrupt and rep == repeats and k == 0:
                    bufs[0][plan[0][0].offset] ^= 0xFF
                    sync()
                parent.send(("bucket", k % 2, plan[k]))
                if k + 1 < len(plan):
                    pack_bucket(bufs[(k + 1) % 2], plan[k + 1], tensors)
                    sync()
                reply = parent.recv()
                if reply != "ack":
                    print(f"gpu_ipc_check: ERROR engine process: {reply}")
                    return 1
            if rep > 0:
                times.append(time.perf_counter() - t0)
        parent.send(("verify",))
        reply = parent.recv()
    finally:
        proc.join(timeout=60)
        transport.close()
    if reply[0] != "verified":
        print(f"gpu_ipc_check: ERROR engine process: {reply}")
        return 1
    _, bad, left = reply
    nbytes = sum(e.nbytes for b in plan for e in b)
    med = statistics.median(times)
    status = "OK" if not bad and not left else "MISMATCH"
    detail = f" bad={bad[:5]} incomplete={left[:5]}" if status != "OK" else ""
    print(f"gpu_ipc_check: {status} device={device} dtype={dtype_name} bytes={nbytes} tensors={len(named)} "
          f"buckets={len(plan)} bucket_bytes={bucket_bytes} median_s={med:.4f} GB/s={nbytes / med / 1e9:.2f}{detail}")
    return 0 if status == "OK" else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--mib", type=float, default=1024.0, help="payload size in MiB (engine dtype)")
    ap.add_argument("--bucket-mib", type=float, default=256.0, help="bucket size in MiB")
    ap.add_argument("--repeats", type=int, default=5, help="timed syncs after one warm-up")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corrupt", action="store_true", help="flip one byte to prove a mismatch is caught")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.mib <= 0 or a.bucket_mib <= 0:
        ap.error("--repeats, --mib and --bucket-mib must be positive")
    return run(a.device, a.mib, a.bucket_mib, a.repeats, a.seed, a.dtype, a.corrupt)


if __name__ == "__main__":
    sys.exit(main())
