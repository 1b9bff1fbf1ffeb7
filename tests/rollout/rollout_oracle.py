"""Float32 oracle checks of the rollout tests (house style rule 3), built to hold on any x86 CPU:
AVX2 or AVX-512, FMA or not, MKL or oneDNN GEMMs, the JIT builds' `-march=native`.

Ground truth is the same model in float64. A float32 path (native step, Python step, HF module,
vLLM, a sampler) is compared with it next to the same-dtype reference (the float32 HF forward or
step), by `check_fp32`: rms|got − truth| ≤ rms|ref − truth| + tol and rms|ref − truth| ≤ tol.

tol = U · depth · scale: the γ_n = n·u bound of a float32 sum of n terms, with n the accumulation
depth of the whole computation (`decode_depth`: every sum a logit passes through) and the
magnitude of the values (max |truth|). That is a worst-case bound per sum, while rounding errors
add like √n (Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019):
the √depth ≈ 35× headroom covers the amplification by the attention softmax and the norms. The
comparison is of rms errors over a whole step, which are stable across CPUs (an average over
hundreds of elements); single elements are not: at one ill-conditioned logit of
test_native_decode the native step's error was 2e-4 with AVX2 + FMA and 1e-5 with AVX-512,
the Python step's 6e-6. Measured over native builds for x86-64-v2 (SSE4.2, no FMA), x86-64-v3
(AVX2 + FMA) and AVX-512, ATen's kernels at default / AVX2 / AVX-512 (ATEN_CPU_CAPABILITY),
oneDNN at SSE4.1 / AVX2 / AVX-512 (ONEDNN_MAX_CPU_ISA) and MKL's own path and its
reproducible one (MKL_CBWR=COMPATIBLE): rms errors per step ≤ 67·U·scale, tol ≈ 1500·U·scale.
A real bug (a wrong formula, position, row or cache slot) moves values by O(scale), rms ≫ tol.

Decisions taken on single elements — which token is the argmax, on which side of a CDF boundary
a uniform falls, which tokens top-k / top-p keep — are checked against float64 up to
`ELEMENT_SPREAD · tol` (the largest single-logit error measured on those builds: 315·U·scale, 5
times the largest rms): two float32 paths may legitimately draw different tokens only where
float64 puts the draw within that of a tie or a boundary, and each path is then checked on its
own trajectory.
"""
from __future__ import annotations

import copy
import math
from typing import List, Optional, Sequence

import torch

from fastgrpo.rollout.decoders import uniforms
from fp32_oracle import U, check_fp32, fp32_tol  # noqa: F401  (the shared check, re-used by the tests here)
ELEMENT_SPREAD = 4  # single-element allowance, in units of the rms tol (see the module doc)


def decode_depth(config, keys: int) -> int:
    """Accumulation depth of a decoder's logits at `keys` attended positions: per layer two norms
    (2H each: LayerNorm's mean and variance; RMSNorm needs H), the q/k/v and gate/up products (H
    each), the scores and Qwen3's head norm (D each), the softmax sum and P·V (keys each), o_proj
    (heads·D) and down_proj (I); then the final norm (2H) and the lm_head (H)."""
    h = getattr(config, "hidden_size", None) or config.n_embd
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    d = getattr(config, "head_dim", None) or h // heads
    inter = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * h
    return layers * (6 * h + 2 * d + 2 * keys + heads * d + inter) + 3 * h


def float64_copy(model):
    return copy.deepcopy(model).double().eval()


def teacher_forced_logits(model, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    """[len(completion), V] logits (the model's dtype) predicting each completion token, in eval
    mode (no dropout: as the engine decodes)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return model(input_ids=ids).logits[0, len(prompt) - 1:-1]
    finally:
        model.train(training)


def process64(z: torch.Tensor, top_k: int, top_p: float, margin: float):
    """(float64 processed logits [V] of z [V] (already divided by τ): top-k then top-p, as
    torch_engine.process_logits; whether a truncation decision lies within `margin` (logits) /
    the matching probability margin of its boundary, where a float32 path may decide either way;
    the set of tokens some path within the margin may keep)."""
    vocab = z.shape[-1]
    keep = torch.ones(vocab, dtype=torch.bool)
    maybe = torch.ones(vocab, dtype=torch.bool)
    ambiguous = False
    if 0 < top_k < vocab:
        s = torch.sort(z, descending=True).values
        kth = s[top_k - 1]
        keep = z >= kth
        maybe = z >= kth - 2 * margin
        ambiguous |= bool(s[top_k - 1] - s[top_k] <= 2 * margin)
    zk = z.masked_fill(~keep, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(zk, descending=True)
        probs = sorted_z.softmax(-1)
        before = probs.cumsum(-1) - probs
        drop = before >= top_p
        drop[0] = False
        p_margin = 2 * margin  # |dp_v| ≤ p_v·2·max|dz|: the mass ahead moves by ≤ 2·margin
        near = (before - top_p).abs() <= p_margin
        ambiguous |= bool((near & torch.isfinite(sorted_z)).any())
        kept = torch.zeros(vocab, dtype=torch.bool)
        kept[idx] = ~drop
        may = torch.zeros(vocab, dtype=torch.bool)
        may[idx] = before < top_p + p_margin
        keep, maybe = keep & kept, maybe & (may | kept)
    return z.masked_fill(~keep, float("-inf")), ambiguous, maybe


def check_rollouts(name: str, model, prompts: List[Sequence[int]], completions, *, temperature: float,
                   top_k: int = 0, top_p: float = 1.0, seeds: Optional[Sequence[int]] = None,
                   budget: Optional[int] = None, model64=None, keep_masks=None) -> int:
    """Every completion's tokens and log-probs against the float64 model, teacher-forced on the
    completion's own tokens (so two paths that part at a tie are each checked on their own):

    - greedy (τ = 0): each token's float64 logit is within ELEMENT_SPREAD · tol of the step's max;
    - sampled, with `seeds` (the engine's per-completion uniforms over `budget` steps): each token
      is the float64 inverse-CDF draw of its uniform, or one beside a boundary within the
      matching probability margin; steps where top-k / top-p truncation is itself within the
      margin (either kept set is right) check only that the token is one some path may keep;
    - log-probs: rms error against float64 ≤ the float32 forward's + tol, with tol from the
      logits' (a log-prob z_y/τ − lse moves by ≤ 2·max|dz|/τ) plus the log-sum-exp's sum over
      the vocabulary.

    `keep_masks[j][t]` 0: a forced token (not drawn, log-prob 0), skipped. Returns the number of
    ambiguous truncation steps (at most a quarter of all: the check cannot quietly vacate)."""
    model64 = model64 if model64 is not None else float64_copy(model)
    got, ref, truth, labels = [], [], [], []
    tol_lp = 0.0
    steps = ambiguous = 0
    tau = temperature if temperature > 0 else 1.0
    for j, (prompt, comp) in enumerate(zip(prompts, completions)):
        toks = list(comp.token_ids)
        if not toks:
            continue
        z64 = teacher_forced_logits(model64, prompt, toks).double()
        z32 = teacher_forced_logits(model, prompt, toks).float()
        tol = fp32_tol(decode_depth(model.config, len(prompt) + len(toks)), z64)
        margin = ELEMENT_SPREAD * tol / tau  # on z / τ
        u = None
        if temperature > 0 and seeds is not None:
            u = uniforms([torch.Generator().manual_seed(seeds[j])], budget or len(toks), "cpu")[0].double()
        mask = keep_masks[j] if keep_masks is not None else [1] * len(toks)
        for t, y in enumerate(toks):
            if not mask[t]:  # a forced token (a thinking budget's interrupt): no draw to check
                continue
            steps += 1
            z = z64[t] / tau
            if temperature == 0:
                assert z[y] >= z.max() - margin, (
                    f"{name}: completion {j} step {t}: token {y} has float64 logit {float(z[y]):.6g}, the "
                    f"maximum is {float(z.max()):.6g} (token {int(z.argmax())}); allowed {margin:.3g}")
                zp, amb = z, False
            else:
                zp, amb, maybe = process64(z, top_k, top_p, margin)
                assert bool(maybe[y]), f"{name}: completion {j} step {t}: token {y} is outside every kept set"
                if amb:
                    ambiguous += 1
                    continue
                p = zp.softmax(-1)
                assert p[y] > 0, f"{name}: completion {j} step {t}: token {y} was truncated"
                if u is not None:
                    cdf = p.cumsum(-1)
                    lo, hi = (float(cdf[y - 1]) if y else 0.0), float(cdf[y])
                    # dp_v ≤ p_v·2·margin: a partial sum of p moves by ≤ 2·margin
                    ok = lo - 2 * margin <= float(u[t]) < hi + 2 * margin
                    assert ok, (f"{name}: completion {j} step {t}: token {y} covers [{lo:.6g}, {hi:.6g}) of the "
                                f"float64 CDF, the uniform is {float(u[t]):.6g}; allowed {2 * margin:.3g}")
            zr = (z32[t].double() / tau).masked_fill(~torch.isfinite(zp), float("-inf"))
            got.append(float(comp.logprobs[t]))
            ref.append(float(zr.log_softmax(-1)[y]))
            truth.append(float(zp.log_softmax(-1)[y]))
            labels.append(f"completion {j} step {t}")
        tol_lp = max(tol_lp, 2 * tol / tau + U * z64.shape[-1])
    check_fp32(f"{name}: log-probs", got, ref, truth, tol_lp, labels)
    assert ambiguous <= steps / 4, f"{name}: {ambiguous} of {steps} steps truncate within rounding of a boundary"
    return ambiguous


def check_greedy_pair(name: str, model64, prompt: Sequence[int], ours: Sequence[int],
                      theirs: Sequence[int]) -> None:
    """Two greedy continuations of `prompt` (ours: the path under test, theirs: a reference such as
    HF generate): equal, or parting at a step where float64 puts both tokens within
    ELEMENT_SPREAD · tol of the maximum (a tie that float32 rounding may break either way).
    Ours is checked step by step by `check_rollouts`."""
    ours, theirs = list(ours), list(theirs)
    if ours == theirs:
        return
    t = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert t < min(len(ours), len(theirs)), f"{name}: lengths {len(ours)} / {len(theirs)} with equal tokens"
    z = teacher_forced_logits(model64, prompt, ours[:t + 1])[t].double()
    margin = ELEMENT_SPREAD * fp32_tol(decode_depth(model64.config, len(prompt) + t + 1), z)
    a, b = ours[t], theirs[t]
    assert min(float(z[a]), float(z[b])) >= float(z.max()) - margin, (
        f"{name}: the continuations part at step {t} ({a} vs {b}) where float64 has logits {float(z[a]):.6g} / "
        f"{float(z[b]):.6g}, maximum {float(z.max()):.6g}: not a tie within {margin:.3g}")


def sampler_tol(z: torch.Tensor, temperature: float, depth: int, lp: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-row worst-case bound [rows] on a float32 sampler's CDF (or, with `lp`, its log-probs)
    against float64, for float32 logits z [rows, V], m = max|z/τ|: z_y/τ and every z_v/τ round
    once (m ulps each), the exp arguments z_v/τ − max once more (≤ 2m), `pick`'s log-sum-exp
    once more (≤ m + ln V); exp ≤ 2 ulp; the float32 partial sums ≤ `depth` ulps (the native
    sampler: blocks of 16 in float, float64 across them; `pick`: torch's sum over the vocabulary,
    depth V); ln V for the log; the result |lp| ulps. A CDF boundary moves by at most half the
    terms' relative error plus the partial sums': within the same bound. Division and float64
    sums round the same everywhere; exp and the float32 sums are what differ between CPUs."""
    zs = (z.double() / (temperature if temperature > 0 else 1.0)).masked_fill(~torch.isfinite(z), 0.0)
    m = zs.abs().amax(-1)
    out = U * (5 * m + depth + 2 * math.log(z.shape[-1]) + 8)
    return out if lp is None else out + U * lp.double().abs()


def check_draws(name: str, tok: torch.Tensor, z: torch.Tensor, temperature: float, u: torch.Tensor,
                depth: int) -> int:
    """Draws tok [rows] of a float32 sampler from z [rows, V] (float32) with uniforms u [rows]:
    each is the float64 inverse-CDF draw, or one beside a boundary the uniform lies within
    `sampler_tol` of; never a token of probability 0. Returns how many differ from float64's."""
    p = torch.softmax(z.double() / temperature, -1)
    cdf = p.cumsum(-1)
    target = u.double() * cdf[:, -1]
    y = tok.long()
    lo = torch.where(y > 0, cdf.gather(1, (y - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(target))
    hi = cdf.gather(1, y[:, None])[:, 0]
    tol = sampler_tol(z, temperature, depth)
    ok = (lo - tol <= target) & (target < hi + tol) & (p.gather(1, y[:, None])[:, 0] > 0)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[:5, 0].tolist()
        raise AssertionError(f"{name}: {int((~ok).sum())} draws off the float64 CDF; rows {bad}: tokens "
                             f"{y[bad].tolist()}, cover {lo[bad].tolist()}..{hi[bad].tolist()}, target "
                             f"{target[bad].tolist()}")
    exact = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return int((exact != y).sum())


def check_sampler_logprobs(name: str, lp: torch.Tensor, tok: torch.Tensor, z: torch.Tensor, temperature: float,
                           depth: int, top_k_mask: Optional[torch.Tensor] = None) -> None:
    """Per-token |lp − float64 log-softmax(z / τ)[tok]| ≤ sampler_tol(·, lp) (τ = 1 for greedy)."""
    zs = z.double() / (temperature if temperature > 0 else 1.0)
    if top_k_mask is not None:
        zs = zs.masked_fill(~top_k_mask, float("-inf"))
    want = torch.log_softmax(zs, -1).gather(-1, tok.long()[:, None])[:, 0]
    tol = sampler_tol(z, temperature, depth, lp)
    err = (lp.double() - want).abs()
    if not bool((err <= tol).all()):
        i = int((err - tol).argmax())
        raise AssertionError(f"{name}: log-prob {float(lp[i]):.9g} vs float64 {float(want[i]):.9g} at row {i}: "
                             f"error {float(err[i]):.3g} > {float(tol[i]):.3g}")



def check_engine(name: str, model, tok, prompts, groups, sampling, model64=None) -> int:
    """`check_rollouts` on an engine's `generate(prompts, n, sampling)` output (seeds: the base
    class's `sampling.seed + j` for flat completion j; uniforms over `max_new_tokens` steps)."""
    ids = [tok(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    flat_ids = [ids[i] for i, g in enumerate(groups) for _ in g]
    flat = [c for g in groups for c in g]
    seeds = None if sampling.seed is None else [sampling.seed + j for j in range(len(flat))]
    return check_rollouts(name, model, flat_ids, flat, temperature=sampling.temperature, top_k=sampling.top_k,
                          top_p=sampling.top_p, seeds=seeds, budget=sampling.max_new_tokens, model64=model64)


def swap_logits(model, prompt, toks, k, mode, old):
    """[len(toks), V] logits predicting each token of `toks` as sampled with a swap after token k
    (model = the new weights, `old` the old ones)."""
    ids = torch.tensor([list(prompt) + list(toks)])
    P = len(prompt)
    with torch.no_grad():
        z_old = old(input_ids=ids).logits[0, P - 1:-1]
        if len(toks) <= k + 1:
            return z_old
        if mode == "abort":
            z_new = model(input_ids=ids).logits[0, P - 1:-1]
        else:  # keep: the old model's cache for prompt + toks[:k], the new model from token k on
            head = old(input_ids=ids[:, :P + k], use_cache=True)
            z_tail = model(input_ids=ids[:, P + k:-1], past_key_values=head.past_key_values).logits[0]
            z_new = torch.cat([z_old[:k + 1], z_tail])
    return torch.cat([z_old[:k + 1], z_new[k + 1:]])


def check_swap(name: str, old, new, prompts, groups, mode: str, n_old: int) -> None:
    """Completions `groups` of `prompts` sampled with a swap from `old` (version 0) to `new`
    (version 1) after each completion's first `n_old` tokens: the version tags say so, and every
    log-prob is the one of the policy that sampled it (float32 next to float64, `swap_logits`'s
    oracle for `mode`); the other mode's oracle must be far away, so the check tells keep from abort."""
    old64, new64 = copy.deepcopy(old).double(), copy.deepcopy(new).double()
    other_mode = "abort" if mode == "keep" else "keep"
    k = n_old - 1
    got, ref, truth, labels, other = [], [], [], [], []
    tol, swapped = 0.0, 0
    for i, g in enumerate(groups):
        for j, c in enumerate(g):
            n = len(c.token_ids)
            assert c.token_versions == [0] * min(n, n_old) + [1] * max(0, n - n_old), (i, j, c.token_versions)
            swapped += n > n_old
            z64 = swap_logits(new64, prompts[i], c.token_ids, k, mode, old64).double()
            z32 = swap_logits(new, prompts[i], c.token_ids, k, mode, old).double()
            zo = swap_logits(new64, prompts[i], c.token_ids, k, other_mode, old64).double()
            tol = max(tol, 2 * fp32_tol(decode_depth(old.config, len(prompts[i]) + n), z64) + 2 ** -24 * z64.shape[-1])
            for t, y in enumerate(c.token_ids):
                got.append(c.logprobs[t])
                ref.append(float(z32[t].log_softmax(-1)[y]))
                truth.append(float(z64[t].log_softmax(-1)[y]))
                labels.append(f"prompt {i} completion {j} token {t}")
                if t > k:
                    other.append((truth[-1], float(zo[t].log_softmax(-1)[y])))
    assert swapped >= 2, "too few completions ran past the swap for the check to mean anything"
    check_fp32(f"{name}: log-probs", got, ref, truth, tol, labels)
    gap = torch.tensor([x - y for x, y in other]).pow(2).mean().sqrt()
    assert gap > 50 * tol, f"keep and abort oracles differ by only {float(gap):.3g} (tol {tol:.3g})"
