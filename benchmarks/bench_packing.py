"""Sequence packing benchmark (issue 4, item 5).

1. Token efficiency = real tokens / computed token slots for a long-tail chain-of-thought length
   distribution (completions log-normal, clipped to 64–16 384 tokens, groups of 8 samples per
   prompt). Padded: micro-batches of one group (8 rows) padded to its longest sequence, slots =
   8·L_max. Packed: first-fit-decreasing into a token budget, slots = bins · budget (a bin is
   sized for the budget, so its unused tail counts as waste). Target ≥ 98 % packed.
2. Balance: Karmarkar–Karp over k = 8 data-parallel ranks, max/mean load (target ≤ 1.03),
   against a contiguous split of the same sequences (what a plain DistributedSampler gives).
3. C++ vs Python time of packing and balancing 100 000 sequences (same results, asserted).
   Shared prefixes on the same groups: the groups `shares_prefix` picks, tokens and modelled
   work saved (a count at two model widths, no timing).
4. Tiny-model forward+backward tokens/s, packed (varlen per-sequence SDPA, lm_head on completion
   positions only) vs padded (groups of 8 right-padded with an attention mask, full logits), on
   CPU. Work floor: both compute the same real tokens; padded also computes 8·L_max − Σ L pad
   slots and lm_head rows for prompt and pad positions. Target ≥ 1.8×.

Run: python -m benchmarks.bench_packing [--prompts 1024] [--timing-seqs 100000] [--model-seqs 64]
     [--model-budget 2048] [--threads 1]
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.harness import Bench, time_fn
from fastgrpo.native import ext as _cext
from fastgrpo.packing import bins as P


def cot_lengths(rng: np.random.Generator, n_prompts: int, group: int = 8, median: float = 1200.0,
                sigma: float = 1.1, lo: int = 64, hi: int = 16384):
    """Prompt lengths (one per group, shared by its samples) and completion lengths (log-normal)."""
    prompt = np.clip(rng.lognormal(np.log(200), 0.5, n_prompts), 16, 1024).astype(np.int64)
    comp = np.clip(rng.lognormal(np.log(median), sigma, n_prompts * group), lo, hi).astype(np.int64)
    return np.repeat(prompt, group), comp


def efficiency(bench: Bench, args, rng) -> None:
    prompt, comp = cot_lengths(rng, args.prompts)
    total = prompt + comp
    g = 8
    padded_slots = sum(g * int(total[i:i + g].max()) for i in range(0, total.size, g))
    bench.add("efficiency padded (group of 8 per micro-batch)", f"seqs={total.size}",
              extra={"efficiency": float(total.sum() / padded_slots), "micro_batches": total.size // g})
    for budget in (32768, 65536):
        bins = P.pack_sequences(total, budget)
        bench.add("efficiency packed FFD", f"seqs={total.size},budget={budget}",
                  extra={"efficiency": float(total.sum() / (len(bins) * budget)), "micro_batches": len(bins)})
    shared_prefix(bench, prompt, comp, g)


def shared_prefix(bench: Bench, prompt, comp, g: int) -> None:
    """Shared-prefix packing on the same groups: which groups the cost model shares (per model
    width: a = 6·hidden), the tokens it saves, and the modelled work (a·L + L² per causal
    sequence, 2·q·k per masked query × key block) it saves. A count, not a timing."""
    for name, hidden in (("0.5B-class, hidden 896", 896), ("7B-class, hidden 4096", 4096)):
        a = 6.0 * hidden
        shared = saved = 0
        work_plain = work_shared = 0.0
        for i in range(0, comp.size, g):
            p, cs = int(prompt[i]), [int(c) for c in comp[i:i + g]]
            plain = sum(a * (p + c) + (p + c) ** 2 for c in cs)
            work_plain += plain
            if P.shares_prefix(p, cs, a):
                shared += 1
                saved += (len(cs) - 1) * p
                work_shared += a * p + p * p + sum(a * c + 2 * c * (p + c) for c in cs)
            else:
                work_shared += plain
        groups = comp.size // g
        bench.add(f"shared prefix, {name}", f"groups={groups},G={g}",
                  extra={"groups_shared": shared / groups, "tokens_saved": saved / float((prompt + comp).sum()),
                         "work_saved": 1.0 - work_shared / work_plain})


def balance(bench: Bench, args, rng) -> None:
    k = 8
    prompt, comp = cot_lengths(rng, args.step_prompts)
    total = prompt + comp
    contiguous = [list(range(r, total.size, k)) for r in range(k)]
    for workload in ("tokens", "attention"):
        for eq in (False, True):
            parts = P.balance_partitions(total, k, equal_size=eq, workload=workload)
            loads = P.partition_loads(total, parts, workload)
            base = P.partition_loads(total, contiguous, workload)
            bench.add(f"balance KK k=8 workload={workload} equal_size={eq}", f"seqs={total.size}",
                      # 6 decimals as text: the harness rounds floats to 4, which shows KK as 1.0
                      extra={"max_over_mean": f"{max(loads) / np.mean(loads):.6f}",
                             "strided_split_max_over_mean": f"{max(base) / np.mean(base):.6f}"})


def timing(bench: Bench, args, rng) -> None:
    prompt, comp = cot_lengths(rng, args.timing_seqs // 8)
    total = prompt + comp
    if _cext.C is None:
        raise SystemExit("fastgrpo._C is not built (or FASTGRPO_DISABLE_EXT=1): nothing to compare")
    cases = [
        ("pack FFD budget=32768", lambda f: f(total, 32768), P.pack_sequences_c, P.pack_sequences_py),
        ("balance KK k=8", lambda f: f(total, 8), P.balance_partitions_c, P.balance_partitions_py),
        ("balance KK k=8 equal_size", lambda f: f(total, 8, True), P.balance_partitions_c,
         P.balance_partitions_py),
    ]
    for name, call, fc, fpy in cases:
        assert call(fc) == call(fpy), f"{name}: backends disagree"
        sc = time_fn(lambda: call(fc), repeats=5, warmup=1)
        sp = time_fn(lambda: call(fpy), repeats=5, warmup=0)
        shape = f"seqs={total.size}"
        bench.add(f"{name} C++", shape, stats=sc)
        bench.add(f"{name} Python", shape, stats=sp, extra={"cpp_speedup": sp.median_s / sc.median_s})


def _tiny_model():
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.tiny import tiny_config

    cfg = tiny_config("qwen2", vocab_size=100, hidden_size=64, num_hidden_layers=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def model_throughput(bench: Bench, args, rng) -> None:
    """fwd+bwd of a token-mean NLL over completion tokens, packed vs padded, same sequences."""
    from fastgrpo.models.packed import packed_logprobs

    n = args.model_seqs
    # Scaled to CPU: the same long-tailed shape (log-normal, σ = 1.1) at 1/16 of the lengths.
    prompt, comp = cot_lengths(rng, n // 8, median=75.0, lo=4, hi=1024)
    prompt = np.clip(prompt // 16, 2, None)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (int(p),), generator=gen) for p in prompt]
    comps = [torch.randint(3, 100, (int(c),), generator=gen) for c in comp]
    real = int((prompt + comp).sum())
    model = _tiny_model()
    budget = int(args.model_budget)
    batches = P.build_packed_batches(prompts, comps, [1.0] * n, budget)

    def packed_step():
        model.zero_grad(set_to_none=True)
        for b in batches:
            (-packed_logprobs(model, b).sum() / b.num_completion_tokens).backward()

    padded = []
    for s in range(0, n, 8):
        rows = [torch.cat([prompts[i], comps[i]]) for i in range(s, min(s + 8, n))]
        T = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), T, dtype=torch.long)
        att = torch.zeros(len(rows), T, dtype=torch.long)
        tgt_mask = torch.zeros(len(rows), T - 1, dtype=torch.bool)
        for r, (row, i) in enumerate(zip(rows, range(s, s + 8))):
            ids[r, :len(row)], att[r, :len(row)] = row, 1
            tgt_mask[r, len(prompts[i]) - 1:len(row) - 1] = True
        padded.append((ids, att, tgt_mask))

    def padded_step():
        model.zero_grad(set_to_none=True)
        for ids, att, tm in padded:
            logp = model(input_ids=ids, attention_mask=att).logits[:, :-1].float().log_softmax(-1)
            lp = logp.gather(-1, ids[:, 1:, None])[..., 0]
            (-(lp * tm).sum() / tm.sum()).backward()

    slots = sum(int(ids.numel()) for ids, _, _ in padded)
    sp = time_fn(padded_step, repeats=5, warmup=1)
    sk = time_fn(packed_step, repeats=5, warmup=1)
    shape = f"seqs={n},real_tokens={real}"
    bench.add("tiny qwen2 fwd+bwd padded (groups of 8)", shape, stats=sp,
              extra={"tokens_per_s": real / sp.median_s, "efficiency": real / slots})
    # efficiency of the packed run = real / (bins·budget) as in part 1, although the varlen
    # attention computes only the real tokens
    bench.add(f"tiny qwen2 fwd+bwd packed (budget {budget})", shape, stats=sk,
              extra={"tokens_per_s": real / sk.median_s, "efficiency": real / (len(batches) * budget),
                     "speedup_vs_padded": sp.median_s / sk.median_s})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=1024, help="prompts (x8 samples) for token efficiency")
    ap.add_argument("--step-prompts", type=int, default=64, help="prompts (x8) of one step for balancing")
    ap.add_argument("--timing-seqs", type=int, default=100_000, help="sequences for C++ vs Python timing")
    ap.add_argument("--model-seqs", type=int, default=64, help="sequences for the tiny-model throughput")
    ap.add_argument("--model-budget", type=int, default=2048, help="token budget of packed micro-batches")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads for the tiny model (1: steadier on shared machines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    bench = Bench("packing")
    efficiency(bench, args, rng)
    balance(bench, args, rng)
    timing(bench, args, rng)
    model_throughput(bench, args, rng)
    bench.finish()


if __name__ == "__main__":
    main()
