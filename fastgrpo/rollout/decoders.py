"""Decode-step pieces of the built-in torch engine (torch_engine.py): sampling, and two steppers
that turn a token per row into next-token logits — `HFStepper` (any HF causal LM, through its
module and DynamicCache) and `LeanStepper` (Qwen2 / Qwen3 / Llama as flat torch ops).

Sampling is inverse-CDF sampling with one uniform per row and step: token y is the first v whose
running sum of p = softmax(z) exceeds u ~ U[0, 1) (cumulated in float64), so y is drawn from
exactly the processed distribution, and a token of probability 0 (a truncated one) can never be
the first to exceed u. Departure from the previous engine (Gumbel-max, the race
`torch.multinomial` runs on CPU): one uniform per step instead of one per vocabulary entry (at
64 rows × 32 steps × V = 104 drawing and log-transforming the Gumbel noise was ~0.8 ms of an
~12 ms rollout), and a per-step pass the native sampler (csrc/jit/sampler.cpp) fuses with
the log-prob and the stop check. The draws for a given seed differ from the Gumbel engine's; the
distribution does not.

Each seeded completion owns a `torch.Generator` that draws its budget's uniforms once, so a
completion does not depend on the rest of the batch; unseeded rows share one `torch.rand` call
(the global generator, checkpointed by the trainer).

The log-prob of the chosen token is `z[y] - logsumexp(z)` on the processed logits.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from fastgrpo.models.lora import effective_weight, lora_terms, warn_once


def uniforms(gens: List[Optional[torch.Generator]], steps: int, device) -> torch.Tensor:
    """u [rows, steps] in [0, 1): row r from gens[r] when it has one (its own stream: the same
    seed gives the same uniforms whatever the batch), else from the global generator."""
    u = torch.empty((len(gens), steps), dtype=torch.float32, device=device)
    unseeded = [r for r, g in enumerate(gens) if g is None]
    for r, g in enumerate(gens):
        if g is not None:
            u[r].uniform_(generator=g)
    if len(unseeded) == len(gens):
        u.uniform_()
    elif unseeded:
        u[torch.tensor(unseeded, device=device)] = torch.rand((len(unseeded), steps), device=device)
    return u


def check_finite(lse: torch.Tensor, step: int) -> None:
    """A row whose logits hold a NaN or +inf, or are all -inf, has no distribution to draw from."""
    bad = ~torch.isfinite(lse)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"sampling: the logits of batch row {i} at step {step} are not finite (a NaN, a +inf, "
                         "or every token masked to -inf): no token can be drawn")


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, u: Optional[torch.Tensor],
         process, step: int = 0) -> tuple:
    """(token [B], log-prob [B]) from float32 logits [B, V]. Greedy when temperature == 0 (τ = 1
    log-probs); else an inverse-CDF draw with uniforms `u` [B] from the distribution
    `process(logits, τ, top_k, top_p)` defines. Non-finite rows: ValueError (see check_finite)."""
    z = logits if temperature == 0 else process(logits, temperature, top_k, top_p)
    lse = torch.logsumexp(z, dim=-1)
    check_finite(lse, step)
    if temperature == 0:
        nxt = z.argmax(-1)
    else:
        cdf = (z - lse[:, None]).exp().double().cumsum(-1)
        # u < 1 in float32, so u · cdf[-1] < cdf[-1] in float64: some entry exceeds the target,
        # and the first that does has a probability > 0
        nxt = torch.searchsorted(cdf, u.double()[:, None] * cdf[:, -1:], right=True)[:, 0]
    lp = z.gather(-1, nxt[:, None])[:, 0] - lse
    return nxt, lp


def _w(m) -> torch.Tensor:
    """The weight a projection computes with: its own, or W + s·B A under an active LoRA adapter
    (PEFT's wrapper exposes only the base weight: reading `.weight` would sample from the base)."""
    return effective_weight(m) if hasattr(m, "lora_A") else m.weight


def _adapter_problem(model) -> Optional[str]:
    """Why a LoRA adapter of `model` cannot be folded into its projections' weights (DoRA, several
    adapters, an adapter bias), None when it can or there is none."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj):
            if hasattr(p, "lora_A"):
                why = lora_terms(p, inference=True)[2]
                if why is not None:
                    return why
    return None


def _cat_bias(*linears) -> Optional[torch.Tensor]:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears])


class HFStepper:
    """Decode steps through the HF module itself (any causal LM): DynamicCache + a growing mask."""

    def __init__(self, model, cache, mask: torch.Tensor):
        self.model, self.cache, self.mask = model, cache, mask

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.mask = self.mask[keep]

    def reload_weights(self, model) -> None:
        """Nothing to do: every step runs the module itself (see LeanStepper.reload_weights)."""

    def step(self, ids: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        res = self.model(input_ids=ids[:, None], attention_mask=self.mask, position_ids=pos[:, None],
                         past_key_values=self.cache, use_cache=True)
        self.cache = res.past_key_values
        return res.logits[:, -1, :].float()


_LEAN_ARCHS = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "LlamaForCausalLM")
# RoPE variants whose inv_freq depends on the sequence length (recomputed per call by HF) are
# left to the HF path; the rest are a fixed inv_freq times `attention_scaling`.
_DYNAMIC_ROPE = ("dynamic", "longrope")


# Models with more weights than this (floats: 64 MiB of float32, beyond any L3 here) prefill with
# one batched forward instead of the native step a position at a time (see native_prefill).
_PREFILL_STEP_WEIGHTS = 1 << 24


def _weights(model) -> int:
    """Parameter count of `model` (cached on the module: a rollout asks once per call)."""
    n = getattr(model, "_fastgrpo_n_weights", None)
    if n is None:
        n = sum(p.numel() for p in model.parameters())
        try:
            model._fastgrpo_n_weights = n
        except (AttributeError, TypeError):
            pass
    return n


def _streamed(w: torch.Tensor, big: int) -> bool:
    """A matrix the native step streams (csrc/jit/decode_step.cpp's gemm_nk: nn.Linear's [out, in]
    layout, dot products over `in`): more than `big` floats (past an L2, read from DRAM each
    step) and rows of >= 256 inputs (shorter rows leave the kernel's horizontal sums unamortised:
    a tiny model's wide lm_head stays transposed, on at::mm)."""
    return w.numel() > big and w.shape[1] >= 256


def native_weights(base, big: int):
    """(WT, WS): the native step's 12 tensors a layer and, for streamed layers, 3 more
    (csrc/jit/decode_step.cpp, lean_step's WT and WS) from the HF decoder `base`. A layer whose
    gate / up matrix is streamed (`_streamed`) passes every matrix as the module holds it (no
    copy), q / k / v and gate / up apart (k, v, up in WS); otherwise they are concatenated and
    transposed once per rollout ([in, out], the cache-resident kernel's layout) and WS is empty."""
    flat, extra = [], []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        empty = a.q_proj.weight.new_empty(0)
        norms = [layer.input_layernorm.weight.contiguous(), layer.post_attention_layernorm.weight.contiguous()]
        qk = ([a.q_norm.weight.contiguous(), a.k_norm.weight.contiguous()] if hasattr(a, "q_norm") else [empty, empty])
        b_qkv, b_gu = _cat_bias(a.q_proj, a.k_proj, a.v_proj), _cat_bias(m.gate_proj, m.up_proj)
        biases = [empty if t is None else t.contiguous() for t in (b_qkv, a.o_proj.bias, b_gu, m.down_proj.bias)]
        if _streamed(m.gate_proj.weight, big):
            w = [_w(t).contiguous() for t in (a.q_proj, a.o_proj, m.gate_proj, m.down_proj, a.k_proj, a.v_proj,
                                              m.up_proj)]
            extra += w[4:]
        else:
            w = [torch.cat([_w(a.q_proj), _w(a.k_proj), _w(a.v_proj)]).t().contiguous(),
                 _w(a.o_proj).t().contiguous(),
                 torch.cat([_w(m.gate_proj), _w(m.up_proj)]).t().contiguous(),
                 _w(m.down_proj).t().contiguous()]
        flat += [norms[0], norms[1], w[0], biases[0], w[1], biases[1], w[2], biases[2], w[3], biases[3],
                 qk[0], qk[1]]
    if extra and len(extra) != 3 * len(base.layers):
        raise ValueError("native_weights: every layer of a model streams its matrices or none does "
                         f"(got {len(extra) // 3} of {len(base.layers)} layers)")
    return flat, extra


class LeanStepper:
    """Decode steps of a Qwen2 / Qwen3 / Llama decoder written as a flat sequence of torch ops over
    the HF module's own weights, with a KV cache pre-allocated to prompt width + budget.

    Why: at hidden 64 a decode step's math is ~0.2 ms while the HF module tree (hooks, mask
    builders, cache objects, rotary module, per-layer kwargs) costs ~0.7 ms more. The ops and their
    order follow transformers' modeling_qwen2 / modeling_llama (RMSNorm in float32, rotate-half
    RoPE, softmax attention with GQA, SiLU-gated MLP; Qwen3's q_norm / k_norm, an RMSNorm over each
    head's head_dim, on q and k after the projection and before RoPE, as modeling_qwen3 does, in
    float32 like every other norm here); q/k/v and gate/up are one matmul each
    (weights concatenated once per rollout call, so the shared trainer module's latest weights are
    used). Departure: attention is written out (baddbmm / softmax / bmm) instead of HF's SDPA
    call; the two agree to ~1e-6 (tests compare tokens and log-probs with the HF path).

    Native step: for float32 on CPU on one thread, `step` runs csrc/jit/decode_step.cpp (JIT-built for the
    host, see fastgrpo/native/decode_step.py) — the same math as plain loops with the GEMMs register-blocked over
    weights transposed at construction and the K cache transposed, so the step makes ~8 ATen
    calls instead of ~45 and runs AVX-512 where MKL would run AVX2. Measured at hidden 64 × 2
    layers, 64 rows, one thread: 313 → 168 µs a step at 8 cached positions, 374 → 234 at 68, 537 →
    371 at 208 (there the cache reads bound both); with 16 rows 177 → 50 µs. As close to a
    float64 step as the Python step is (tests/rollout/test_nativedecoders.py). `native=False`, the engine's
    `decoder="lean"` or `FASTGRPO_NATIVE_DECODE=0` keep the Python step.
    """

    @staticmethod
    def supports(model) -> bool:
        cfg = getattr(model, "config", None)
        if type(model).__name__ not in _LEAN_ARCHS or cfg is None:
            return False
        why = _adapter_problem(model)
        if why is not None:  # an adapter the lean / native steps cannot fold into W: the HF module runs
            warn_once(f"lean-lora-{why}", f"the built-in engine's lean decode steps step aside for a LoRA adapter "
                      f"with {why}; the HF module (PEFT's layers) decodes instead")
            return False
        rope = getattr(model.model, "rotary_emb", None)
        layer_types = getattr(cfg, "layer_types", None) or ()
        return (getattr(cfg, "hidden_act", None) == "silu" and rope is not None
                and getattr(rope, "rope_type", "default") not in _DYNAMIC_ROPE
                and all(t == "full_attention" for t in layer_types)
                # one eps for every norm: the native step takes one (HF builds all from rms_norm_eps)
                and all(getattr(layer.self_attn, n).variance_epsilon == model.model.norm.variance_epsilon
                        for layer in model.model.layers for n in ("q_norm", "k_norm")
                        if hasattr(layer.self_attn, n)))

    @staticmethod
    def native_module(model, device) -> Optional[object]:
        """csrc/jit/decode_step.cpp's module where the native step applies to `model` (float32 on CPU, an
        even head dim) and builds, else None. On one intra-op thread for any model; on more only
        for a streamed model (its GEMMs split their weight rows over the threads, gemm_nk): the
        cache-resident kernel is single-threaded, and MKL's GEMMs are not."""
        if (model.model.embed_tokens.weight.dtype != torch.float32 or torch.device(device).type != "cpu"
                or model.model.layers[0].self_attn.head_dim % 2):
            return None
        from fastgrpo.native.decode_step import decode_step_module

        mod = decode_step_module()
        if mod is None or torch.get_num_threads() == 1:
            return mod
        streamed = mod.streamed_kernel and _streamed(model.model.layers[0].mlp.gate_proj.weight, mod.streamed_weight)
        return mod if streamed else None

    def __init__(self, model, cache, mask: torch.Tensor, max_new_tokens: int, native: bool = True,
                 weights_from: Optional["LeanStepper"] = None):
        cfg, base = model.config, model.model
        attn0 = base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = attn0.scaling
        self.eps = base.norm.variance_epsilon
        self.inv_freq = base.rotary_emb.inv_freq.float()
        self.rope_scale = float(base.rotary_emb.attention_scaling)
        self.embed = base.embed_tokens.weight
        self.norm_w = base.norm.weight
        self.lm_head = model.lm_head
        B, width = mask.shape
        size = width + max_new_tokens
        dtype = self.embed.dtype
        # the native step (csrc/jit/decode_step.cpp): float32 on CPU, where it builds. It keeps the
        # K cache transposed ([B, Hkv, D, S]) and takes its weights from `native_weights` (no
        # concatenated copies); the Python step below concatenates q/k/v and gate/up once per
        # rollout call (so the shared trainer module's latest weights are used)
        self.native = self.native_module(model, mask.device) if native else None
        if weights_from is not None and weights_from.native is self.native:
            # a stepper over the same weights (fastgrpo.rollout.continuous re-lays its batch out
            # at each admission): its prepared copies serve, instead of concatenating them again
            for name in self._WEIGHT_ATTRS:
                if hasattr(weights_from, name):
                    setattr(self, name, getattr(weights_from, name))
        else:
            self.reload_weights(model)
        shape = (B, self.n_kv, size, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=mask.device) for _ in base.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        if self.native is not None:  # K stored transposed: a [B, Hkv, D, S] buffer, seen as [B, Hkv, S, D]
            self.k = [k.transpose(2, 3).contiguous().transpose(2, 3) for k in self.k]
        for i in range(len(self.k) if cache is not None else 0):  # None: native_prefill fills them
            self.k[i][:, :, :width] = cache.layers[i].keys
            self.v[i][:, :, :width] = cache.layers[i].values
        if self.native is not None:
            self.k = [k.transpose(2, 3) for k in self.k]  # the contiguous [B, Hkv, D, S] buffers
        # additive attention bias over the static cache: -inf on left padding, 0 elsewhere
        self.bias = torch.zeros((B, size), dtype=dtype, device=mask.device)
        self.bias[:, :width].masked_fill_(mask == 0, float("-inf"))
        self.width = width
        # RoPE tables for every position this rollout can reach (< width + budget), computed as
        # HF does per call (float32 positions × inv_freq, cos / sin × attention_scaling), so a
        # step gathers two rows instead of ~10 ops; the sin table has its first half negated:
        # rotate_half(x) * sin = roll(x, D/2) * (sin with its first half negated)
        freqs = torch.arange(size, dtype=torch.float32, device=mask.device)[:, None] * self.inv_freq.to(mask.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sin = emb.sin() * self.rope_scale
        self.cos_t = (emb.cos() * self.rope_scale).to(dtype)
        self.sin_t = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(dtype)

    # what reload_weights prepares (shared by `weights_from`)
    _WEIGHT_ATTRS = ("layers", "_flat", "_streamed", "_norm_w", "_lm_streamed", "_lm_wt", "_lm_b")

    def reload_weights(self, model) -> None:
        """Take the weights of `model` (the one this stepper was built on, updated in place) into the
        per-call copies the steps read — concatenated q/k/v and gate/up (Python step), the native
        step's transposed matrices — leaving the KV cache as it is. At construction, and when the
        weights change in the middle of a call (rollout.inflight=keep: the tokens so far keep
        their keys and values, the next steps run the new weights)."""
        self.layers = []
        for layer in model.model.layers if self.native is None else ():
            a, m = layer.self_attn, layer.mlp
            # Qwen3's per-head norm weights as one [nh + nkv, D] table over the q and k heads of a
            # step's qkv (q_norm's row for each q head, k_norm's for each k head); None elsewhere
            qk_w = (torch.cat([a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)])
                    if hasattr(a, "q_norm") else None)
            self.layers.append((
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                torch.cat([_w(a.q_proj), _w(a.k_proj), _w(a.v_proj)]),
                _cat_bias(a.q_proj, a.k_proj, a.v_proj),
                _w(a.o_proj), a.o_proj.bias,
                torch.cat([_w(m.gate_proj), _w(m.up_proj)]), _cat_bias(m.gate_proj, m.up_proj),
                _w(m.down_proj), m.down_proj.bias,
                *((a.q_norm.weight, a.k_norm.weight) if qk_w is not None else (None, None)), qk_w))
        if self.native is not None:
            big = self.native.streamed_weight
            self._flat, self._streamed = native_weights(model.model, big)
            lm_w = self.lm_head.weight
            self._norm_w = self.norm_w.contiguous()
            self._lm_streamed = _streamed(lm_w, big)
            self._lm_wt = lm_w.contiguous() if self._lm_streamed else lm_w.t().contiguous()
            self._lm_b = self.lm_head.bias.contiguous() if self.lm_head.bias is not None else lm_w.new_empty(0)

    @classmethod
    def native_prefill(cls, model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int):
        """(stepper, last-position logits [rows, V]) for left-padded prompts `ids` / `mask`
        [rows, width], the prompt run through the native step a position at a time; None where
        the native step is not available (the caller then runs the HF forward and `__init__`).

        Why: for a GRPO batch's few distinct ~10-token prompts the HF forward (module tree, mask
        builders, SDPA) plus copying its DynamicCache into the static one cost ~1.5 ms of a ~10 ms
        rollout; `width` native steps on a handful of rows cost ~0.3 ms and write the static
        cache in place. Positions and masking are the HF prefill's (position = index among the
        row's real tokens; a left-pad query sees no key and attends to nothing, see csrc/jit/decode_step.cpp),
        so the cache and logits agree with it up to float32 rounding (tests compare them).

        Only for models up to `_PREFILL_STEP_WEIGHTS`: a position at a time reads every weight once
        per position, which pays while the weights stay in cache; past that (SmolLM2-135M: 540 MB
        of float32 weights) one batched HF forward over all positions is a GEMM at full speed
        (4 prompts × 49 positions on one thread: ~0.5 s against 49 weight streams, ~4.6 s)."""
        if cls.native_module(model, mask.device) is None or _weights(model) > _PREFILL_STEP_WEIGHTS:
            return None
        stepper = cls(model, None, mask, max_new_tokens)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, pos = ids.t().contiguous(), pos.t().contiguous()  # a contiguous column per position
        logits = None
        width = mask.shape[1]
        for s in range(width):
            # only the last position's logits are read: earlier positions write their K / V and
            # skip the lm_head (rows × vocab × hidden, most of a prefill step at a real vocabulary)
            logits = stepper._native_step(ids[s], pos[s], s, s == width - 1)
        return stepper, logits

    def select(self, keep: torch.Tensor) -> None:
        self.k = [k[keep] for k in self.k]
        self.v = [v[keep] for v in self.v]
        self.bias = self.bias[keep]

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:        # HF's float32 formula in one fused op (bit-equal here)
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(x.dtype)

    def _head_norm(self, qk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Qwen3's q_norm / k_norm on qk [b, nh + nkv, D] with the per-head weight table w
        [nh + nkv, D]: HF's float32 RMSNorm over D, then the weight (so the same rounding)."""
        if qk.dtype == torch.float32:
            return torch.nn.functional.rms_norm(qk, (qk.shape[-1],), None, self.eps) * w
        h = qk.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * h.to(qk.dtype)

    def _native_step(self, ids: torch.Tensor, pos: torch.Tensor, s: int, want_logits: bool = True) -> torch.Tensor:
        return self.native.lean_step(ids.contiguous(), pos.contiguous(), s, self.embed, self.cos_t, self.sin_t,
                                     self.bias, self._flat, self._streamed, self.k, self.v, self._norm_w, self._lm_wt,
                                     self._lm_b,
                                     self.n_heads, self.n_kv, self.head_dim, float(self.scaling), float(self.eps),
                                     want_logits, self._lm_streamed)

    def step(self, ids: torch.Tensor, pos: torch.Tensor, slot: int) -> torch.Tensor:
        """Logits [b, V] (float32) after feeding token `ids` [b] at positions `pos` [b] into cache
        slot `width + slot`."""
        b, D, s = ids.shape[0], self.head_dim, self.width + slot
        nh, nkv, g = self.n_heads, self.n_kv, self.n_heads // self.n_kv
        if self.native is not None:
            return self._native_step(ids, pos, s)
        x = self.embed[ids]
        cos, sin = self.cos_t[pos][:, None, :], self.sin_t[pos][:, None, :]
        half = D // 2
        # attention as baddbmm (scale + additive mask + QK^T in one op) → softmax → bmm: 50 µs
        # against SDPA's 77 µs at b = 64, S = 45 on one thread; query heads of one KV head are
        # the rows of one small matrix, so GQA needs no repeat of K / V.
        bias = self.bias[:, None, None, :s + 1].expand(b, nkv, g, s + 1).reshape(b * nkv, g, s + 1)
        for i, (w_in, w_post, w_qkv, b_qkv, w_o, b_o, w_gu, b_gu, w_down, b_down, _, _, w_qk) in enumerate(self.layers):
            qkv = torch.nn.functional.linear(self._norm(x, w_in), w_qkv, b_qkv).view(b, nh + 2 * nkv, D)
            qk = qkv[:, :nh + nkv]         # RoPE on q and k heads together
            if w_qk is not None:           # Qwen3: per-head RMSNorm before RoPE
                qk = self._head_norm(qk, w_qk)
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
            self.k[i][:, :, s] = qk[:, nh:]
            self.v[i][:, :, s] = qkv[:, nh + nkv:]
            keys = self.k[i][:, :, :s + 1].reshape(b * nkv, s + 1, D)
            vals = self.v[i][:, :, :s + 1].reshape(b * nkv, s + 1, D)
            att = torch.baddbmm(bias, qk[:, :nh].reshape(b * nkv, g, D), keys.transpose(1, 2), alpha=self.scaling)
            o = torch.bmm(att.softmax(-1, dtype=torch.float32).to(vals.dtype), vals).view(b, nh * D)
            x = x + torch.nn.functional.linear(o, w_o, b_o)
            gu = torch.nn.functional.linear(self._norm(x, w_post), w_gu, b_gu)
            gate, up = gu.chunk(2, dim=-1)
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down, b_down)
        return torch.nn.functional.linear(self._norm(x, self.norm_w), self.lm_head.weight, self.lm_head.bias).float()
