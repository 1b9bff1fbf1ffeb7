"""Fused float32 CPU decoder layers for packed training forwards (Qwen2, Qwen3, Llama, Mistral).

On one CPU thread a tiny model's packed forward + backward is dominated by its elementwise
passes, not its GEMMs: Hugging Face's decoder layer runs about 30 ATen ops forward and 60
backward per layer (RMSNorm alone is 6 forward), each a pass over activations that no longer
sit in cache, plus autograd's bookkeeping for each. Measured on the e2e benchmark's update (tiny
Qwen2, ~1.9k tokens, one thread): GEMMs 6 ms of 24. With this module the packed forward +
backward of that model is 1.81× faster, 1.27× at hidden 256 × 4 layers and 1.02× at Qwen2-0.5B
widths, where GEMMs dominate (`python -m benchmarks.bench_fused_layer --threads 1`).

`FusedDecoderLayer` runs the whole layer as one autograd function with four GEMMs forward
(q‖k‖v, o, gate‖up, down: the projections of one input concatenated into one product) and
eight backward, and the rest as one-pass C++ loops (`train_ops.cpp`, the attention in
`train_attn.cpp`, JIT-built for the host
like the native decode step, `fastgrpo.native.jit`): RMSNorm (and Qwen3's per-head q / k norms), RoPE
in place on the q‖k columns,
varlen causal attention over the packed segments (with the shared-prefix layout of
`PackedBatch.segment_prefix`; logsumexp kept, probabilities recomputed in the backward, as
flash attention does), SiLU·up, residual adds fused into the norm backward. It saves x, the
two normed inputs, q‖k‖v after RoPE, the attention output and logsumexp, the residual and
gate‖up (the weights' concatenations are rebuilt in the backward): less than the Hugging Face
layer keeps. The GEMMs go to oneDNN where `cpu_gemm` would
send the layer's linears (a row count on its ladder), else to torch's own.

Where it runs: `use_fused_layers(model)` (called by `fastgrpo.trainer.build.build_model`) swaps the
class of every decoder layer and RMSNorm of a supported architecture to a subclass (so
isinstance checks, parameters, state dict, deepcopy and pickle are unchanged) whose forward
takes the fused path only for the packed varlen forward of `fastgrpo.models.packed` (float32, CPU, no
autocast, not under torch.compile, no KV cache, no attention dropout, no forward or backward
hooks on the layer's parts, no part replaced since the swap (another activation; a PEFT
LoRA wrapper is taken: its adapter runs inside the layer, fastgrpo/models/fused_lora.py), weights of the swapped shapes and not partitioned by ZeRO-3) and is the model's own
forward otherwise (generation, prefills, bf16, GPU). `FASTGRPO_FUSED_LAYERS=0`, or a failed build (one warning),
keep the model's own layers everywhere. The backward is once-differentiable: a double backward
(`create_graph=True`) through a fused layer raises an error.

Departures from the model's own layer, all float32 rounding: sums in another order, e^x by a
polynomial within 2 ulp (`tests/models/test_fused_layer.py` compares outputs and every gradient to the
float64 model). Supported: q/k/v/o biases (Qwen2), GQA, any even head dim, the model's own RoPE
tables (any scaling, full rotary dim), Qwen3's q / k norms. Not supported (the layer stays the
model's own): sliding windows, MLP biases, activations other than SiLU, partial rotary.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from fastgrpo import env

from fastgrpo.native.train_ops import ops_module

from fastgrpo.models import onednn as cpu_gemm
from fastgrpo.models.fused_lora import (base_linear, group_terms, lora_args, lora_backward, lora_columns, lora_forward,
                                        lora_modules)
from fastgrpo.models.lora import warn_once
from fastgrpo.models.packed import PACKED_CALL, PAD_KWARG, PREFIX_KWARG, VARLEN_ATTN, tensor_version

# set on a model by use_fused_layers
FUSED_ATTR = "_fastgrpo_fused_layers"
# the architectures whose layers compute exactly: x + attn(norm(x)); h + down(silu(gate(·)) · up(·))
# (Qwen3: with an RMSNorm over each q and k head before RoPE)
_LAYER_MODULES = {
    "Qwen2DecoderLayer": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3DecoderLayer": "transformers.models.qwen3.modeling_qwen3",
    "LlamaDecoderLayer": "transformers.models.llama.modeling_llama",
    "MistralDecoderLayer": "transformers.models.mistral.modeling_mistral",
}
# the linear classes whose forward is exactly F.linear (a subclass swapped in by LoRA / quantisation is not)
_LINEARS = (nn.Linear, cpu_gemm.FastLinear)
_NORM_MODULES = {
    "Qwen2RMSNorm": "transformers.models.qwen2.modeling_qwen2",
    "Qwen3RMSNorm": "transformers.models.qwen3.modeling_qwen3",
    "LlamaRMSNorm": "transformers.models.llama.modeling_llama",
    "MistralRMSNorm": "transformers.models.mistral.modeling_mistral",
}


# ------------------------------------------------------------------ the packed segments
_LAST_SEG: list = [None]


def _segments(cu: torch.Tensor, prefix: Optional[torch.Tensor], rows: int) -> torch.Tensor:
    """int64 [S, 4]: (start, length, prefix start, prefix length) per segment, checked against
    the row count (`rows` ≥ the last segment's end: the rest is ladder padding). Every layer of
    one forward (and a checkpointed recomputation) gets the same tensors: built once."""
    key, key_prefix = cu, prefix
    version = (tensor_version(cu), None if prefix is None else tensor_version(prefix))
    last = _LAST_SEG[0]
    if (last is not None and last[0] is cu and last[2] is prefix and None not in version[:1 + (prefix is not None)]
            and last[1] == version):
        return last[3]
    cu = cu.to(torch.int64)
    if cu.dim() != 1 or cu.numel() < 1 or bool((cu[1:] < cu[:-1]).any()) or int(cu[0]) != 0:
        raise ValueError(f"cu_seq_lens_q: expected a non-decreasing 1-D tensor from 0, got {cu.tolist()[:8]}…")
    if int(cu[-1]) > rows:
        raise ValueError(f"cu_seq_lens_q ends at token {int(cu[-1])} but the packed row has {rows}")
    start, length = cu[:-1], cu[1:] - cu[:-1]
    s = start.numel()
    if prefix is None:
        ps = pl = torch.zeros(s, dtype=torch.int64)
    else:
        prefix = prefix.to(torch.int64)
        if prefix.shape != (s, 2):
            raise ValueError(f"segment_prefix: expected {s} (start, length) rows (one per segment), "
                             f"got shape {tuple(prefix.shape)}")
        ps, pl = prefix[:, 0], prefix[:, 1]
        bad = (pl != 0) & ~((ps >= 0) & (pl > 0) & (ps + pl <= start))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(f"segment_prefix[{i}] = ({int(ps[i])}, {int(pl[i])}): a prefix must be a span of "
                             f"tokens (length >= 0) before its segment, which starts at token {int(start[i])}")
        ps = torch.where(pl > 0, ps, torch.zeros_like(ps))
        pl = pl.clamp(min=0)
    seg = torch.stack([start, length, ps, pl], 1).contiguous()
    _LAST_SEG[0] = (key, version, key_prefix, seg)
    return seg


def _gemm(a: torch.Tensor, b_t: torch.Tensor, bias, dnn: bool) -> torch.Tensor:
    """a @ b_t.T (+ bias): oneDNN when the row count is on cpu_gemm's ladder, else torch."""
    return cpu_gemm._mm(a, b_t, bias) if dnn else F.linear(a, b_t, bias)


def _wgrad(x_t: torch.Tensor, g: torch.Tensor, dnn: bool) -> torch.Tensor:
    """The weight gradient gᵀ x [N, K] from xᵀ [K, T] (dense) and g [T, N], as (xᵀ g)ᵀ: oneDNN
    copies a strided left operand on every call, so the one given dense is the narrower
    activation (measured at T = 1920: 64 × 256 gate‖up 446 → 285 µs with the transpose)."""
    return _gemm(x_t, g.t(), None, dnn).t().contiguous()


class _Spec:
    __slots__ = ("ops", "seg", "nq", "nk", "d", "scale", "eps1", "eps2", "eps_h", "dnn", "biases", "split", "grad",
                 "lora")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


class _DecoderLayerFn(torch.autograd.Function):
    """y = x2 + down(silu(gate(n2)) · up(n2)), x2 = x + o(attn(rope(qkv(n1)))), n1 = norm1(x),
    n2 = norm2(x2); x [T, H] float32 dense. A LoRA'd projection P adds s·(n Aᵀ) Bᵀ to its output
    (`lw`: A, B of q k v o gate up down in turn, None where a projection has no adapter on)."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec, w_in, wq, wk, wv, bq, bk, bv, wo, bo, w_post, wg, wu, wd, wqn, wkn, *lw):
        ops, dnn = spec.ops, spec.dnn
        h1, r1 = ops.rmsnorm_fwd(x, w_in, spec.eps1)
        wqkv = torch.cat([wq, wk, wv])
        bqkv = None
        if spec.biases[:3] != (False, False, False):
            bqkv = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for b, w in ((bq, wq), (bk, wk), (bv, wv))])
        qkv = _gemm(h1, wqkv, bqkv, dnn)
        sc = spec.lora
        qkv_cols = lora_columns(spec.split)
        if sc is not None:
            lora_forward(qkv, h1, group_terms(lw, sc, 0, 3), qkv_cols)
        pre = hr = None
        if wqn is not None:  # Qwen3: each q and k head RMS-normed before RoPE
            pre, hr = ops.head_rmsnorm_(qkv, wqn, wkn, spec.nq, spec.nk, spec.d, spec.eps_h)
        ops.rope_(qkv, cos, sin, spec.nq + spec.nk, spec.d, False)
        o, lse = ops.attn_fwd(qkv, spec.seg, spec.nq, spec.nk, spec.d, spec.scale)
        x2 = _gemm(o, wo, bo.contiguous() if bo is not None else None, dnn).add_(x)
        if sc is not None:
            lora_forward(x2, o, group_terms(lw, sc, 3, 4), ((0, x2.shape[1]),))
        h2, r2 = ops.rmsnorm_fwd(x2, w_post, spec.eps2)
        wgu = torch.cat([wg, wu])
        gu = _gemm(h2, wgu, None, dnn)
        if sc is not None:
            lora_forward(gu, h2, group_terms(lw, sc, 4, 6), lora_columns((wg.shape[0], wu.shape[0])))
        act = ops.silu_mul_fwd(gu)
        y = _gemm(act, wd, None, dnn).add_(x2)
        if sc is not None:
            lora_forward(y, act, group_terms(lw, sc, 6, 7), ((0, y.shape[1]),))
        if spec.grad:  # (no-grad forwards, old / reference log-probs, keep nothing)
            # the normed inputs are read again only by the weight gradients, as their transposes
            h1, h2 = ops.transpose(h1), ops.transpose(h2)
            # the weights themselves, not their concatenations: those are rebuilt in the backward
            # (a copy of the layer's weights per forward would outweigh the activations it saves)
            ctx.save_for_backward(x, h1, r1, qkv, o, lse, x2, h2, r2, gu, cos, sin, w_in, wq, wk, wv, wo, w_post, wg,
                                  wu, wd, pre, hr, wqn, wkn, *lw)
        ctx.spec = spec
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        # h1, h2: the normed inputs' transposes [H, T]
        (x, h1, r1, qkv, o, lse, x2, h2, r2, gu, cos, sin, w_in, wq, wk, wv, wo, w_post, wg, wu, wd, pre, hr, wqn,
         wkn, *lw) = ctx.saved_tensors
        wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
        spec = ctx.spec
        ops, dnn, need, sc = spec.ops, spec.dnn, ctx.needs_input_grad, spec.lora
        gy = gy.contiguous()
        g = [None] * (19 + len(lw))
        act = ops.silu_mul_fwd(gu) if need[16] or sc is not None else None
        if need[16]:
            g[16] = _gemm(gy.t(), act.t(), None, dnn)
        dact = _gemm(gy, wd.t(), None, dnn)
        if sc is not None:  # the adapters' gradients (A, B) and their share of each input gradient
            lora_backward(gy, act, group_terms(lw, sc, 6, 7), ((0, gy.shape[1]),), dact, g, 19 + 12)
        dgu = ops.silu_mul_bwd(dact, gu)
        if need[14] or need[15]:
            g[14], g[15] = _wgrad(h2, dgu, dnn).split(wgu.shape[0] // 2)
        dh2 = _gemm(dgu, wgu.t(), None, dnn)
        if sc is not None:
            lora_backward(dgu, h2.t(), group_terms(lw, sc, 4, 6), lora_columns((wg.shape[0], wu.shape[0])), dh2, g, 19 + 8)
        dx2, g[13] = ops.rmsnorm_bwd(dh2, x2, w_post, r2, gy)
        if need[11]:
            g[11] = _wgrad(ops.transpose(o), dx2, dnn)
        if spec.biases[3] and need[12]:
            g[12] = dx2.sum(0)
        do = _gemm(dx2, wo.t(), None, dnn)
        if sc is not None:
            lora_backward(dx2, o, group_terms(lw, sc, 3, 4), ((0, dx2.shape[1]),), do, g, 19 + 6)
        dqkv = ops.attn_bwd(do, qkv, o, lse, spec.seg, spec.nq, spec.nk, spec.d, spec.scale)
        ops.rope_(dqkv, cos, sin, spec.nq + spec.nk, spec.d, True)
        if wqn is not None:
            g[17], g[18] = ops.head_rmsnorm_bwd_(dqkv, pre, hr, wqn, wkn, spec.nq, spec.nk, spec.d)
        if any(need[5:8]):
            g[5], g[6], g[7] = _wgrad(h1, dqkv, dnn).split(spec.split)
        if any(spec.biases[:3]):
            gb = dqkv.sum(0).split(spec.split)
            for i in range(3):
                if spec.biases[i] and need[8 + i]:
                    g[8 + i] = gb[i]
        dh1 = _gemm(dqkv, wqkv.t(), None, dnn)
        if sc is not None:
            lora_backward(dqkv, h1.t(), group_terms(lw, sc, 0, 3), lora_columns(spec.split), dh1, g, 19)
        g[0], g[4] = ops.rmsnorm_bwd(dh1, x, w_in, r1, dx2)
        return tuple(g)



class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ops, eps):
        y, r = ops.rmsnorm_fwd(x, w, eps)
        ctx.save_for_backward(x, w, r)
        ctx.ops = ops
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, w, r = ctx.saved_tensors
        dx, dw = ctx.ops.rmsnorm_bwd(gy.contiguous(), x, w, r, None)
        return dx, dw, None, None


# ------------------------------------------------------------------ when the fused path runs
def _packed_call() -> bool:
    return PACKED_CALL.get()


def _plain_f32(x: torch.Tensor) -> bool:
    return (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def _foreign(hooks) -> bool:
    # transformers' output recorder (`output_capturing_hook`, installed on attention modules once
    # any forward asks for hidden states) records only what packed forwards never ask for
    return any("output_capturing_hook" not in getattr(h, "__qualname__", "") for h in hooks.values())


def _hooked(parts) -> bool:
    """Whether a forward hook on one of the layer's parts (which the fused path does not call)
    would be skipped."""
    g = nn.modules.module
    return any((m._forward_hooks and _foreign(m._forward_hooks)) or m._forward_pre_hooks or m._backward_hooks
               or m._backward_pre_hooks for m in parts if m is not None) or bool(
        g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
        or g._global_backward_pre_hooks)


def _shapes(params) -> tuple:
    return tuple(None if p is None else tuple(p.shape) for p in params)


def _layer_params(layer) -> tuple:
    at, mlp = layer.self_attn, layer.mlp
    qn, kn = getattr(at, "q_norm", None), getattr(at, "k_norm", None)
    return (layer.input_layernorm.weight, at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, at.q_proj.bias,
            at.k_proj.bias, at.v_proj.bias, at.o_proj.weight, at.o_proj.bias, layer.post_attention_layernorm.weight,
            mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, None if qn is None else qn.weight,
            None if kn is None else kn.weight)


def _parts(layer) -> tuple:
    at, mlp = layer.self_attn, layer.mlp
    return (at, mlp, at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
            mlp.act_fn, layer.input_layernorm, layer.post_attention_layernorm, getattr(at, "q_norm", None),
            getattr(at, "k_norm", None))


def _same_parts(layer) -> bool:
    """Whether the layer's parts are still the modules checked at the swap: a part replaced since
    (a wrapper other than PEFT's LoRA exposing its base layer's `weight`, another activation, a
    module with hooks) has a forward that the fused path would skip. A PEFT LoRA wrapper put
    around a checked linear (before or after the swap) is taken: the adapter is computed here."""
    now = tuple(base_linear(m) if 2 <= i < 9 else m for i, m in enumerate(_parts(layer)))
    was = tuple(base_linear(m) if 2 <= i < 9 else m for i, m in enumerate(layer._fastgrpo_parts))
    return (all(a is b for a, b in zip(now, was))
            and all(type(m) in _LINEARS for m in now[2:9]) and type(now[9]) is layer._fastgrpo_act)


def _params_ok(params) -> bool:
    # ZeRO-3 partitions (0-element, gathered by hooks the fused path would skip), other dtypes
    return all(p is None or (p.dtype == torch.float32 and p.device.type == "cpu" and not hasattr(p, "ds_id")
                             and p.is_contiguous()) for p in params)


class FusedDecoderLayer:
    """Mixin put in front of a supported decoder layer class (see the module doc)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        at = self.self_attn
        params = _layer_params(self)
        ops = None
        if (cu is not None and past_key_values is None and attention_mask is None
                and self._fastgrpo_shapes == _shapes(params)
                # the model's own RoPE tables over the full head dim (partial rotary: not this kernel's)
                and position_embeddings is not None and position_embeddings[0].shape[-1] == self._fastgrpo_heads[2]
                and hidden_states.dim() == 3 and hidden_states.shape[0] == 1 and _plain_f32(hidden_states)
                and getattr(at.config, "_attn_implementation", None) == VARLEN_ATTN
                and not (at.training and at.attention_dropout > 0)
                and _same_parts(self) and not _hooked(self._fastgrpo_parts) and _params_ok(params)
                # one eps for both head norms in the kernel: checked at the swap, and again here
                and (params[13] is None or at.q_norm.variance_epsilon == at.k_norm.variance_epsilon)
                and not _hooked(lora_modules(_parts(self)[2:9]))):  # hooks on a PEFT wrapper or its adapters
            scales, lw, why = lora_args(_parts(self)[2:9])
            if why is not None:  # an adapter this kernel cannot compute: PEFT's own layers run
                warn_once(f"fused-lora-{why}", f"the fused CPU decoder layers step aside for a LoRA adapter with {why}; "
                          "the model's own layers (PEFT's) run instead")
            elif _params_ok(lw):
                ops = ops_module()
        if ops is None:
            return super().forward(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, use_cache=use_cache,
                                   position_embeddings=position_embeddings, **kwargs)
        x = hidden_states[0].contiguous()
        t = x.shape[0]
        seg = _segments(cu, kwargs.get(PREFIX_KWARG), t)
        end = int(seg[-1, 0] + seg[-1, 1]) if len(seg) else 0
        if end + kwargs.get(PAD_KWARG, 0) != t:
            raise ValueError(f"cu_seq_lens_q ends at token {end} but the query has {t} rows "
                             f"({kwargs.get(PAD_KWARG, 0)} of them ladder padding): they must agree")
        cos, sin = position_embeddings
        cos, sin = (c.reshape(t, c.shape[-1]).float().contiguous() for c in (cos, sin))
        nq, nk, d = self._fastgrpo_heads
        dnn = cpu_gemm._enabled() and t >= cpu_gemm.MIN_ROWS and cpu_gemm.padded_rows(t) == t
        spec = _Spec(ops=ops, seg=seg, nq=nq, nk=nk, d=d, scale=float(at.scaling),
                     eps1=float(self.input_layernorm.variance_epsilon),
                     eps2=float(self.post_attention_layernorm.variance_epsilon),
                     eps_h=float(at.q_norm.variance_epsilon) if params[13] is not None else 0.0, dnn=dnn,
                     biases=tuple(p is not None for p in params[4:7]) + (params[8] is not None,),
                     split=(nq * d, nk * d, nk * d), grad=torch.is_grad_enabled(), lora=scales)
        y = _DecoderLayerFn.apply(x, cos, sin, spec, *params, *lw)
        return y[None]


class FusedRMSNorm:
    """Mixin put in front of a supported RMSNorm class outside the decoder layers (the final
    norm): in a packed forward, one C++ pass each way."""

    def forward(self, hidden_states):
        ops = None
        # (the norm's own hooks run around this forward, whichever path it takes)
        if (_plain_f32(hidden_states) and _packed_call() and _params_ok((self.weight,))
                and tuple(self.weight.shape) == hidden_states.shape[-1:]):
            ops = ops_module()
        if ops is None:
            return super().forward(hidden_states)
        h = hidden_states.shape[-1]
        y = _RMSNormFn.apply(hidden_states.reshape(-1, h).contiguous(), self.weight, ops,
                             float(self.variance_epsilon))
        return y.view(hidden_states.shape)


_CLASSES: dict = {}


def _fused_class(base: type, mixin: type) -> type:
    name = f"Fused{base.__name__}"
    cls = _CLASSES.get(name)
    if cls is None:
        cls = _CLASSES[name] = type(name, (mixin, base), {"__module__": __name__, "__qualname__": name})
    return cls


def __getattr__(name: str):
    """`FusedQwen2DecoderLayer` etc. for pickle (the classes are made on first use)."""
    import importlib

    if name.startswith("Fused"):
        base = name[len("Fused"):]
        where = _LAYER_MODULES.get(base) or _NORM_MODULES.get(base)
        if where is not None:
            cls = getattr(importlib.import_module(where), base)
            return _fused_class(cls, FusedDecoderLayer if base in _LAYER_MODULES else FusedRMSNorm)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _layer_ok(layer) -> bool:
    at, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if at is None or mlp is None:
        return False
    linears = [getattr(at, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    linears = [base_linear(m) for m in linears]  # a PEFT LoRA wrapper: its adapter is computed in the layer
    if not all(type(m) in _LINEARS for m in linears):
        return False
    if any(m.bias is not None for m in linears[4:]):  # MLP biases: not this kernel's
        return False
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if not all(type(n).__name__ in _NORM_MODULES and hasattr(n, "variance_epsilon") for n in norms):
        return False
    qk = (getattr(at, "q_norm", None), getattr(at, "k_norm", None))
    if type(layer).__name__ == "Qwen3DecoderLayer":  # its q / k heads are RMS-normed (over the head dim)
        if not all(type(n).__name__ in _NORM_MODULES and hasattr(n, "variance_epsilon")
                   and getattr(n, "weight", None) is not None and n.weight.shape == (at.head_dim,) for n in qk):
            return False
        if qk[0].variance_epsilon != qk[1].variance_epsilon:
            return False
    elif qk != (None, None):
        return False
    cfg = getattr(at, "config", None)
    if cfg is None or getattr(cfg, "hidden_act", None) != "silu" or getattr(at, "sliding_window", None) is not None:
        return False
    d = getattr(at, "head_dim", None)
    nq, nk = getattr(cfg, "num_attention_heads", 0), getattr(cfg, "num_key_value_heads", None) or 0
    if not d or d % 2 or not nq or not nk or nq % nk:
        return False
    h = linears[0].in_features
    return (linears[0].out_features == nq * d and linears[1].out_features == nk * d
            and linears[2].out_features == nk * d and linears[3].in_features == nq * d
            and norms[0].weight.shape == (h,) and norms[1].weight.shape == (h,) and hasattr(at, "scaling"))


def use_fused_layers(model: nn.Module) -> int:
    """Swap the class of every supported decoder layer and RMSNorm of a float32 `model` in place
    (see the module doc); returns how many layers were swapped. Nothing is compiled here: the
    C++ ops build on the first packed forward that takes them."""
    if not env.fused_layers():
        return 0
    n = 0
    for m in model.modules():
        base = type(m)
        if base.__name__ in _LAYER_MODULES and _layer_ok(m) and m.input_layernorm.weight.dtype == torch.float32:
            at = m.self_attn
            m.__class__ = _fused_class(base, FusedDecoderLayer)
            m._fastgrpo_heads = (at.q_proj.out_features // at.head_dim, at.k_proj.out_features // at.head_dim,
                                 at.head_dim)
            # the shapes the kernels were checked against: a layer whose weights are later
            # replaced by others of another shape takes the model's own forward
            m._fastgrpo_shapes = _shapes(_layer_params(m))
            m._fastgrpo_parts = _parts(m)
            m._fastgrpo_act = type(m.mlp.act_fn)
            n += 1
    # the norms outside the decoder layers (the final one): a layer's own norms run inside the
    # fused layer, or inside the model's own layer, which gradient checkpointing may recompute
    # after the packed call has ended (the norm could not tell: it would dispatch differently)
    inner = {id(x) for m in model.modules() if type(m).__name__ in _LAYER_MODULES or isinstance(m, FusedDecoderLayer)
             for x in m.modules()}
    for m in model.modules():
        base = type(m)
        if (base.__name__ in _NORM_MODULES and id(m) not in inner and hasattr(m, "variance_epsilon")
                and getattr(m, "weight", None) is not None):
            m.__class__ = _fused_class(base, FusedRMSNorm)
    if n:
        setattr(model, FUSED_ATTR, True)
    return n


def restore_layers(model: nn.Module) -> int:
    """Undo `use_fused_layers`: every fused layer and norm back to its model's class; returns
    how many layers."""
    n = 0
    for m in model.modules():
        cls = type(m)
        if cls.__name__ in _CLASSES and _CLASSES[cls.__name__] is cls:
            m.__class__ = cls.__mro__[2]
            if isinstance(m, nn.Module) and hasattr(m, "_fastgrpo_heads"):
                del m._fastgrpo_heads, m._fastgrpo_parts, m._fastgrpo_shapes, m._fastgrpo_act
                n += 1
    if hasattr(model, FUSED_ATTR):
        delattr(model, FUSED_ATTR)
    return n
