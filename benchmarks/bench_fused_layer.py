"""Packed forward + backward of float32 CPU models: the model's own decoder layers (with the oneDNN
linears of fastgrpo.models.onednn, the previous default) vs fastgrpo.models.fused_layer, side by side (the
two alternate within each repeat), medians.

A case is a model shape and a packed batch of P prompts × G completions in the trainer's
layout (shared prompts where the packing cost model takes them): the forward of every token,
the final norm, and the backward of a loss on the completion positions' hidden states (the
lm_head and the GRPO loss are the same on both sides and left out).

    python -m benchmarks.bench_fused_layer --threads 1
"""
from __future__ import annotations

import argparse
import copy

import torch

from benchmarks.harness import Bench, time_interleaved

# name: (hidden, layers, heads, kv heads, head dim, intermediate, completion length range)
CASES = {
    "tiny (demo / e2e), 32-token completions": (64, 2, 2, 1, 32, 128, (4, 33)),
    "tiny (demo / e2e), 256-token completions": (64, 2, 2, 1, 32, 128, (16, 257)),
    "h256 x 4 layers, GQA 4:2, 128-token completions": (256, 4, 4, 2, 64, 768, (8, 129)),
    "h896 x 2 layers (Qwen2-0.5B widths), 64-token completions": (896, 2, 14, 2, 64, 4864, (8, 65)),
}


def _case(bench, name, shape, repeats, prompts, group, seed=0):
    from fastgrpo.models.onednn import use_onednn_linears
    from fastgrpo.models.tiny import build_tiny_model
    from fastgrpo.models.fused_layer import restore_layers, use_fused_layers
    from fastgrpo.models.packed import can_share_prefix, packed_forward, packing_attn_coef
    from fastgrpo.packing import build_packed_batches

    hidden, layers, heads, kv, hd, inter, (lo, hi) = shape
    fused, _ = build_tiny_model("qwen2", seed=seed, hidden_size=hidden, num_hidden_layers=layers,
                                intermediate_size=inter, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
    use_onednn_linears(fused)
    if use_fused_layers(fused) == 0:
        print("[bench_fused_layer] the fused layers are off (FASTGRPO_FUSED_LAYERS=0): nothing to compare")
        return None
    own = copy.deepcopy(fused)
    restore_layers(own)
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(prompts):
        p = torch.randint(3, 40, (int(torch.randint(8, 16, (1,), generator=gen)),), generator=gen).tolist()
        seqs += [(p, torch.randint(3, 40, (int(torch.randint(lo, hi, (1,), generator=gen)),), generator=gen).tolist())
                 for _ in range(group)]
    batch = build_packed_batches([p for p, _ in seqs], [c for _, c in seqs], [0.0] * len(seqs), 10 ** 7,
                                 group_size=group, share_prefix=can_share_prefix(fused),
                                 attn_coef=packing_attn_coef(fused))[0]

    def step(model):
        def run():
            model.zero_grad(set_to_none=True)
            packed_forward(model, batch).square().mean().backward()
        return run

    st = time_interleaved({"model's own layers": step(own), "fused layers": step(fused)}, repeats)
    base = st["model's own layers"].median_s
    tokens = batch.input_ids.numel()
    for k, s in st.items():
        bench.add(case=f"{name}: {k}", shape=f"{tokens} tokens", stats=s,
                  extra={"tokens_per_s": round(tokens / s.median_s), "speedup": round(base / s.median_s, 2)})
    return base / st["fused layers"].median_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    bench = Bench("fused_layer")
    ratios = {}
    for name in a.cases:
        r = _case(bench, name, CASES[name], a.repeats, a.prompts, a.group)
        if r is not None:
            ratios[name] = r
    bench.finish()
    print("fused layers speed-up: " + "; ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
