"""float32 linear layers on CPU through oneDNN's GEMM where it beats the default BLAS.

PyTorch's CPU `mm` / `addmm` for float32 call MKL's sgemm. MKL picks its code path by CPU
vendor: on AMD CPUs with AVX-512 (Zen 4 / Zen 5, the CI machines) it runs its AVX2 kernels,
about 105 GFLOP/s on one core, while oneDNN's JIT kernels (the library behind
`torch.ops.mkldnn._linear_pointwise`, which inductor uses) run AVX-512 at about 220 GFLOP/s.
Measured on one core of the CI machine (`python -m benchmarks.bench_cpu_gemm`), a
[1726, 64] × [64, 128] linear: 261 → 127 µs forward, 262 → 132 µs for the input gradient,
307 → 210 µs for the weight gradient. Below about 128 rows oneDNN's fixed cost loses (a
64-row decode step: 12 vs 16 µs), so small products stay on `F.linear`.

The op is the one inductor's CPU backend emits for linears (`mkldnn._linear_pointwise`); the
departure is calling it in eager mode for float32 training, with our own backward.

`FastLinear` is a drop-in `nn.Linear` (same parameters, state dict and class checks: it is a
subclass) whose forward sends float32 CPU inputs whose row count is on the ladder below through
`OneDNNLinear`, an autograd function whose three products (output, input gradient, weight
gradient) all run on oneDNN (a double backward, `create_graph=True`, differentiates plain torch
products); everything else (other dtypes, devices, row counts off the ladder) is `F.linear` as
before. `use_onednn_linears(model)` swaps the class of a float32 model's `nn.Linear` modules in
place (`fastgrpo.trainer.build.build_model` does so for the models it builds); `restore_linears(model)`
undoes it.

oneDNN builds (JIT-compiles) a primitive per shape and caches it (1024 by default): a new row
count costs 0.4 ms (forward) to 1.1 ms (weight gradient) once, twice the product itself. A
packed batch has a new token count nearly every step, so oneDNN only takes row counts on a
ladder (`padded_rows`: multiples of 64 up to 1024 rows, so at most 63 rows of padding, then 16
steps per octave, so at most 6.25 %) and the packed forward of a float32 model
(`fastgrpo.models.packed`) pads its row to the ladder with tokens that attend nothing and are dropped;
any other row count (a prefill, a decode step) stays on `F.linear`. A run meets a bounded set of
shapes, each compiled once.

Selection: `FASTGRPO_CPU_GEMM=auto` (default: oneDNN on AMD CPUs where PyTorch runs its
AVX-512 kernels; on Intel, MKL already runs AVX-512), `onednn` (wherever the op exists), `mkl` /
`off` (never). The
rule is fixed per machine, not timed at run time, so a resumed run computes exactly what an
uninterrupted one does. Both libraries sum in float32; results agree to float32 rounding
(`tests/models/test_onednn.py` checks outputs and all gradients against `F.linear`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from fastgrpo import env
from fastgrpo.native import cpuinfo

# set on a model by use_onednn_linears: packed forwards then pad their row to the ladder
ONEDNN_ATTR = "_fastgrpo_onednn_linears"
MIN_ROWS = 128  # oneDNN's per-call cost loses below this (measured: tie at 128 rows, 1.5× at 256)
# A product of at least this many multiply-adds goes to oneDNN at any row count ≥ MIN_ROWS: at
# ≥ 2^28 MACs (≥ 2.4 ms at 220 GFLOP/s) building a primitive for a new row count (0.4–1.1 ms,
# once per shape) costs less than MKL's AVX2 path loses on that one call. The lm_head of a
# packed batch ([completion tokens, hidden] × [vocab, hidden]: 914 × 576 × 49 152 on SmolLM2)
# has a new row count each step and is the largest product of the update.
BIG_MACS = 1 << 28
_MIN_STEP = 64  # the ladder's finest step (below 1024 rows), so a 129-token row pads to 192, not 256


@functools.lru_cache(maxsize=None)
def _op_available() -> bool:
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x = torch.ones(2, 3)
        return bool(torch.equal(op(x, torch.ones(4, 3), None, "none", [], ""), torch.full((2, 4), 3.0)))
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def _cpu_vendor() -> str:
    return cpuinfo.vendor()


def onednn_enabled() -> bool:
    """Whether float32 CPU linears on the ladder go to oneDNN on this machine (see module doc):
    `auto` takes AMD CPUs with AVX-512 (where MKL runs AVX2: the measured case); on Intel MKL
    already runs AVX-512, so the ladder padding would buy nothing measured."""
    mode = env.cpu_gemm()
    if mode in ("mkl", "off") or not _op_available():
        return False
    return mode == "onednn" or (torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16")
                                and _cpu_vendor() == "AuthenticAMD")


def _mm(a: torch.Tensor, b_t: torch.Tensor, bias=None) -> torch.Tensor:
    """a @ b_t.T (+ bias) on oneDNN (a: [M, K], b_t: [N, K], any strides; bias dense)."""
    return torch.ops.mkldnn._linear_pointwise(a, b_t, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with the forward and both gradients on oneDNN. x: [M, K] float32 CPU."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _mm(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gx = gw = gb = None
        if torch.is_grad_enabled():
            # double backward (create_graph=True): the same products as differentiable torch ops
            if ctx.needs_input_grad[0]:
                gx = g @ weight
            if ctx.needs_input_grad[1]:
                gw = g.t() @ x
        else:
            # strided views, no copies (measured faster than making W^T or x^T dense first:
            # 123 vs 133 µs at [1726, 64]·[64, 128]; 36 vs 40 ms at [1024, 896]·[896, 4864])
            if ctx.needs_input_grad[0]:
                gx = _mm(g, weight.t())  # g W
            if ctx.needs_input_grad[1]:
                gw = _mm(g.t(), x.t())  # g^T x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb


def padded_rows(rows: int) -> int:
    """The smallest row count ≥ `rows` on oneDNN's shape ladder (see the module doc); `rows`
    itself when oneDNN is off on this machine or `rows` < MIN_ROWS."""
    if rows < MIN_ROWS or not _enabled():
        return rows
    step = max(_MIN_STEP, (1 << (rows.bit_length() - 1)) // 16)
    return -(-rows // step) * step


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """`F.linear`, through oneDNN for float32 CPU inputs whose row count is on the ladder
    (`padded_rows(rows) == rows`, ≥ MIN_ROWS), or off it for products of ≥ BIG_MACS, when enabled.
    Falls back to `F.linear` under CPU autocast (which would cast to bf16), for ZeRO-3
    partitioned weights (DeepSpeed wraps F.linear for those) and inside `torch.compile` (the
    compiler picks its own GEMMs)."""
    if torch.compiler.is_compiling():
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    big = rows * x.shape[-1] * (weight.shape[0] if weight.dim() == 2 else 0) >= BIG_MACS if rows else False
    if (rows < MIN_ROWS or (rows != padded_rows(rows) and not big) or x.device.type != "cpu" or x.dtype != torch.float32
            or weight.dtype != torch.float32 or weight.dim() != 2 or (bias is not None and bias.dtype != torch.float32)
            or hasattr(weight, "ds_id") or torch.is_autocast_enabled("cpu") or not _enabled()):
        return F.linear(x, weight, bias)
    if bias is not None:
        bias = bias.contiguous()  # oneDNN reads the bias as dense memory whatever its strides
    y = OneDNNLinear.apply(x.reshape(rows, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


@functools.lru_cache(maxsize=None)
def _enabled() -> bool:
    return onednn_enabled()


class FastLinear(nn.Linear):
    """`nn.Linear` whose large float32 CPU products run on oneDNN (see the module doc)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Swap every plain `nn.Linear` of `model` to `FastLinear` in place (parameters, hooks and
    state dict untouched) when oneDNN is enabled on this machine; returns how many were swapped.
    Subclasses of nn.Linear (quantised, …) are left alone. A PEFT LoRA wrapper is not a linear but
    holds one: its base layer is swapped (the base GEMM on oneDNN) and its adapter's small
    products run beside it, so patching after LoRA (as build_model does) keeps this path."""
    if not _enabled():
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.float32:
            m.__class__ = FastLinear
            n += 1
    if n:
        setattr(model, ONEDNN_ATTR, True)
    return n


def restore_linears(model: nn.Module) -> int:
    """Undo `use_onednn_linears`: every `FastLinear` back to `nn.Linear`; returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is FastLinear:
            m.__class__ = nn.Linear
            n += 1
    if hasattr(model, ONEDNN_ATTR):
        delattr(model, ONEDNN_ATTR)
    return n
