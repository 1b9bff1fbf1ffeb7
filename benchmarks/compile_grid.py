"""Compile every Triton kernel of kernels/triton/ for Hopper (sm_90) and the fallback GPUs
(sm_80) on a machine without a GPU, with Triton's bundled ptxas, and check each build:

- it compiles;
- bf16 / fp16 / fp32 builds do not spill (LOCAL / STACK bytes of `cuobjdump -res-usage`);
- aligned builds (layouts "a" and "t": row stride a multiple of 16) load the logits with
  128-bit vector loads: the SASS holds at least one LDG.E.128 per 16 bytes of logits a thread
  reads per block (elements per thread × element size / 16);
- registers and shared memory fit the occupancy the configs are chosen for: at least
  `MIN_WARPS_PER_SM` resident warps per SM (bandwidth-bound kernels need loads in flight);
- num_stages = 2 compiles to the same SASS as 1 (the kernels issue no async copies), which is
  why the tables keep num_stages = 1 only (`--stages` checks it).

Layouts: "a" V and row stride multiples of 16; "t" row stride aligned, odd V (a sliced
vocabulary: 151 655 live rows of a 151 936 matrix); "u" odd row stride (a contiguous [N, 50 257]),
checked for compile and spills only: unaligned rows cannot be vector-loaded.
The launch specialisation is mimicked: Triton marks a pointer (16-byte aligned storage) or an
integer divisible by 16 with tt.divisibility = 16, which is what vectorisation keys on.

    python benchmarks/compile_grid.py               # the whole grid, a table, exit 1 on a failure
    python benchmarks/compile_grid.py --ci          # the representative set the CI test runs
    python benchmarks/compile_grid.py --stages      # also compare num_stages 1 vs 2
Runs with TRITON_INTERPRET unset (it re-executes itself without it).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_WARPS_PER_SM = 16  # 25 % occupancy on sm_80 / sm_90 (64 warps per SM)
MIN_WARPS_CCE = 8  # the matmul kernels: one 8-warp CTA per SM with its 64×128 fp32 accumulator
_SM = {90: dict(regs=65536, smem=228 * 1024, warps=64, blocks=32),
       80: dict(regs=65536, smem=164 * 1024, warps=64, blocks=32)}
_T = {"bf16": ("bf16", 2), "fp16": ("fp16", 2), "fp32": ("fp32", 4), "fp64": ("fp64", 8)}


@dataclasses.dataclass(frozen=True)
class Build:
    kernel: str  # "fwd" (token log-probs), "bwd" (logits gradient), "cce_fwd" / "cce_bwd" (fused lm_head)
    arch: int  # 90 or 80
    dtype: str  # logits dtype
    flag: bool  # HAS_ENT (fwd) / HAS_H (bwd)
    layout: str  # "a", "t" or "u"
    block_n: int
    block_v: int
    num_warps: int
    num_stages: int = 1
    targets: str = "i64"
    block_h: int = 0  # cce kernels: hidden columns per dot step
    softcap: bool = False  # HAS_SOFTCAP (Gemma 2's final-logit cap: a tanh per element, more registers)


def _spec(b: Build):
    """(jit function, signature, constexprs, indices of args marked divisible by 16)."""
    from fastgrpo.kernels.triton.grpo_loss import _grpo_loss_bwd_kernel
    from fastgrpo.kernels.triton.logprobs import _token_logprobs_fwd_kernel

    t, _ = _T[b.dtype]
    acc = "fp64" if b.dtype == "fp64" else "fp32"
    stride_ok = b.layout != "u"
    cols_ok = b.layout == "a"
    if b.kernel.startswith("cce"):
        return _cce_spec(b, t)
    if b.kernel == "fwd":
        fn = _token_logprobs_fwd_kernel
        sig = {"logits_ptr": f"*{t}", "targets_ptr": f"*{b.targets}", "logp_ptr": f"*{acc}", "lse_ptr": f"*{acc}",
               "ent_ptr": f"*{acc}", "stride_n": "i32", "n_rows": "i32", "n_cols": "i32",
               "inv_temp": "fp32", "inv_temp_lo": "fp32", "softcap": "fp32", "softcap_lo": "fp32"}
        consts = {"HAS_ENT": b.flag, "HAS_SOFTCAP": b.softcap}
        div = list(range(5)) + ([5] if stride_ok else []) + [6] + ([7] if cols_ok else [])
    else:
        fn = _grpo_loss_bwd_kernel
        sig = {"logits_ptr": f"*{t}", "grad_ptr": f"*{t}", "targets_ptr": f"*{b.targets}", "lse_ptr": f"*{acc}",
               "g_ptr": f"*{acc}", "h_ptr": f"*{acc}", "ent_ptr": f"*{acc}", "stride_n": "i32", "stride_gn": "i32",
               "n_rows": "i32", "n_cols": "i32", "inv_temp": "fp32", "inv_temp_lo": "fp32", "softcap": "fp32",
               "softcap_lo": "fp32"}
        consts = {"HAS_H": b.flag, "HAS_SOFTCAP": b.softcap}
        div = list(range(7)) + ([7, 8] if stride_ok else []) + [9] + ([10] if cols_ok else [])
    consts.update(FP64=b.dtype == "fp64", BLOCK_N=b.block_n, BLOCK_V=b.block_v)
    for k in consts:
        sig[k] = "constexpr"
    return fn, sig, consts, div


def _cce_spec(b: Build, t: str):
    """The fused lm_head kernels (kernels/triton/fused_linear.py): H a multiple of 16, so the
    operand rows are aligned; V aligned or odd (the column clamp keeps the loads along H)."""
    from fastgrpo.kernels.triton.fused_linear import _cce_bwd_kernel, _cce_fwd_kernel

    cols_ok = b.layout == "a"
    if b.kernel == "cce_fwd":
        fn = _cce_fwd_kernel
        ptrs = ["h_ptr", "w_ptr", "b_ptr", "targets_ptr", "logp_ptr", "lse_ptr", "ent_ptr"]
        types = [f"*{t}"] * 3 + [f"*{b.targets}"] + ["*fp32"] * 3
        ints = ["stride_hn", "stride_wv", "n_rows", "n_cols", "n_hidden"]
        consts = {"HAS_BIAS": True, "HAS_ENT": b.flag, "HAS_SOFTCAP": b.softcap}
    else:
        fn = _cce_bwd_kernel
        ptrs = ["h_ptr", "w_ptr", "b_ptr", "targets_ptr", "lse_ptr", "g_ptr", "hh_ptr", "ent_ptr", "dh_ptr", "dw_ptr",
                "db_ptr"]
        types = [f"*{t}"] * 3 + [f"*{b.targets}"] + ["*fp32"] * 7
        ints = ["stride_hn", "stride_wv", "stride_dhn", "stride_dwv", "n_rows", "n_cols", "n_hidden"]
        consts = {"HAS_BIAS": True, "HAS_H": b.flag, "HAS_SOFTCAP": b.softcap, "HAS_DH": True, "HAS_DW": True,
                  "HAS_DB": True}
    sig = dict(zip(ptrs, types))
    sig.update({k: "i32" for k in ints})
    sig["inv_temp"] = "fp32"
    sig["softcap"] = "fp32"
    consts.update(BLOCK_N=b.block_n, BLOCK_V=b.block_v, BLOCK_H=b.block_h)
    for k in consts:
        sig[k] = "constexpr"
    div = [i for i, k in enumerate(sig) if k in ptrs or (k in ints and (cols_ok or k != "n_cols"))]
    return fn, sig, consts, div


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_build(b: Build) -> dict:
    """Compile one build and read its resources and SASS; never raises (errors are a result)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    res = dict(dataclasses.asdict(b), ok=False, error="", regs=0, spill=0, shared=0, ldg128=0, ldg_narrow=0,
               need128=0, warps_per_sm=0, sass_hash="")
    try:
        fn, sig, consts, div = _spec(b)
        attrs = {(i,): [["tt.divisibility", 16]] for i in div}
        ck = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", b.arch, 32),
                            options={"num_warps": b.num_warps, "num_stages": b.num_stages})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(ck.asm["cubin"])
            f.flush()
            usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
            sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout
        fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
        res.update(regs=int(fields.get("REG", 0)), spill=int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0)),
                   shared=max(int(fields.get("SHARED", 0)), int(ck.metadata.shared)))
        loads = re.findall(r"\bLDG\.E(\.[A-Z0-9.]+)?", sass)
        res["ldg128"] = sum(1 for w in loads if w and ".128" in w)
        res["ldg_narrow"] = len(loads) - res["ldg128"]
        elem = _T[b.dtype][1]
        per_thread = b.block_n * b.block_v // (32 * b.num_warps)
        # cce: the operand tiles, at least one 128-bit load; the others: every logits element
        res["need128"] = 1 if b.kernel.startswith("cce") else max(1, per_thread * elem // 16)
        res["sass_hash"] = hashlib.sha1(re.sub(r"/\*[0-9a-f]{4}\*/", "", sass).encode()).hexdigest()[:16]
        res["warps_per_sm"] = _resident_warps(b.arch, res["regs"], res["shared"], b.num_warps)
        res["ok"] = True
    except Exception as e:  # a failing build is a row of the table
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _resident_warps(arch: int, regs: int, shared: int, warps: int) -> int:
    """Resident warps per SM from the register file (allocated per warp in 256-register units),
    shared memory (+1 KiB reserved per block) and the block / warp limits."""
    sm = _SM[arch]
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = sm["regs"] // (per_warp * warps)
    by_smem = sm["smem"] // (shared + 1024)
    blocks = min(by_regs, by_smem, sm["blocks"], sm["warps"] // warps)
    return blocks * warps


def failures(r: dict) -> list:
    """The checks of the module docstring, as a list of reasons (empty: the build passes)."""
    if not r["ok"]:
        return [f"compile: {r['error']}"]
    out = []
    if r["dtype"] != "fp64" and r["spill"] > 0:
        out.append(f"spills {r['spill']} B")
    if r["layout"] in "at" and r["ldg128"] < r["need128"]:
        out.append(f"{r['ldg128']} LDG.E.128 < {r['need128']} needed")
    if r["warps_per_sm"] < (MIN_WARPS_CCE if r["kernel"].startswith("cce") else MIN_WARPS_PER_SM):
        out.append(f"{r['warps_per_sm']} warps/SM < {MIN_WARPS_PER_SM} (regs {r['regs']}, smem {r['shared']})")
    return out


def grid(ci: bool = False, stages: bool = False) -> list:
    from fastgrpo.kernels.triton import _tune

    sets = {90: _tune.SM90, 80: _tune.FALLBACK}
    builds = []
    for arch, table in sets.items():
        for dtype, (_, elem) in _T.items():
            for kernel in ("fwd", "bwd"):
                for flag, cap in ((False, False), (True, False), (True, True)):
                    # the table the launchers use for this dtype (the capped backward: as for fp32)
                    heavy = cap and kernel == "bwd"
                    cfgs = _tune.configs_for(table, max(elem, _tune.HEAVY_MIN_ELEM_BYTES) if heavy else elem)
                    unaligned = set(_tune.candidates(cfgs, 1 << 17, "u"))
                    for c in cfgs:
                        for layout in "atu":
                            if layout == "u" and c not in unaligned:
                                continue  # never picked for unaligned rows
                            builds.append(Build(kernel, arch, dtype, flag, layout, c.block_n, c.block_v,
                                                c.num_warps, c.num_stages, softcap=cap))
    for arch in sets:
        for kernel in ("cce_fwd", "cce_bwd"):
            for dtype in ("bf16", "fp16", "fp32"):
                bn, bv, bh, w = _cce_blocks(dtype)
                for flag, cap in ((False, False), (True, False), (True, True)):
                    for layout in "at":
                        builds.append(Build(kernel, arch, dtype, flag, layout, bn, bv, w, block_h=bh, softcap=cap))
    if stages:
        builds += [dataclasses.replace(b, num_stages=2) for b in builds  # the logits kernels (cce uses tl.dot)
                   if b.arch == 90 and b.dtype == "bf16" and b.layout == "a" and b.flag and not b.softcap
                   and b.kernel in ("fwd", "bwd")]
    if ci:
        # Representative (~25 builds, ~25 s cold on 2 cores): every Hopper config's backward (the
        # register-heavy kernel) in bf16 with HAS_H; the two extreme tiles for the forward, the
        # odd-V layout, fp32 / fp16 and the unaligned layout; fp64, the fallback set's 64-row tile,
        # int32 targets once each. HAS_SOFTCAP (a tanh and its derivative per element: the most
        # registers) on every Hopper backward config in bf16, the fp32 extremes and the cce kernels.
        extreme = {(1, 8192, 16), (64, 128, 8), (64, 128, 16)}
        keep = []
        for b in builds:
            cfg = (b.block_n, b.block_v, b.num_warps)
            if b.num_stages != 1 or not b.flag:
                continue
            if b.softcap:
                if b.arch == 90 and b.layout == "a" and (
                        (b.kernel == "bwd" and b.dtype == "bf16") or (cfg in extreme and b.dtype == "fp32")
                        or (b.kernel.startswith("cce") and b.dtype in ("bf16", "fp32"))):
                    keep.append(b)
                continue
            if b.arch == 90 and b.kernel == "bwd" and b.dtype == "bf16" and b.layout == "a":
                keep.append(b)
            elif b.arch == 90 and cfg in extreme and (
                    (b.dtype == "bf16" and b.layout in "tu") or (b.kernel == "fwd" and b.dtype == "bf16")
                    or (b.layout == "a" and b.dtype in ("fp32", "fp16") and b.kernel == "bwd")):
                keep.append(b)
        keep += [b for b in builds if b.kernel.startswith("cce") and b.arch == 90 and b.flag and b.layout == "a"
                 and b.dtype in ("bf16", "fp32")]
        keep += [Build("fwd", 90, "fp64", True, "a", 1, 4096, 16), Build("bwd", 80, "bf16", True, "a", 64, 64, 8),
                 Build("fwd", 80, "bf16", True, "a", 64, 64, 8), Build("bwd", 80, "bf16", True, "a", 16, 256, 8),
                 Build("bwd", 90, "fp32", True, "u", 2, 4096, 16),
                 Build("fwd", 90, "bf16", True, "a", 1, 4096, 8, targets="i32")]
        builds = list(dict.fromkeys(keep))
    return builds


def _cce_blocks(dtype: str):
    """The GPU tiles of kernels/triton/fused_linear.py (its interpreter tiles differ)."""
    import torch

    from fastgrpo.kernels.triton import fused_linear

    saved = fused_linear.INTERPRET
    fused_linear.INTERPRET = False
    try:
        return fused_linear._blocks(1 << 16, 1 << 17, 4096, getattr(torch, {"bf16": "bfloat16", "fp16": "float16",
                                                                            "fp32": "float32"}[dtype]))
    finally:
        fused_linear.INTERPRET = saved


def run(builds, workers: int = 1) -> list:
    if workers > 1:
        with ProcessPoolExecutor(workers) as ex:
            return list(ex.map(compile_build, builds))
    return [compile_build(b) for b in builds]


def stage_duplicates(results) -> list:
    """(build, same) for every num_stages = 2 build: whether its SASS equals the 1-stage one's."""
    one = {dataclasses.replace(Build(**{k: r[k] for k in Build.__dataclass_fields__}), num_stages=1): r["sass_hash"]
           for r in results if r["num_stages"] == 1}
    out = []
    for r in results:
        if r["num_stages"] == 2:
            key = dataclasses.replace(Build(**{k: r[k] for k in Build.__dataclass_fields__}), num_stages=1)
            out.append((r, one.get(key) == r["sass_hash"]))
    return out


def table(results) -> str:
    head = "| kernel | sm | dtype | flag | cap | layout | BN×BV/warps/stages | regs | spill B | smem B | LDG.128 (need) | narrow LDG | warps/SM | s | check |"
    lines = [head, "|" + "---|" * 15]
    for r in results:
        bad = failures(r)
        bh = f"×{r['block_h']}" if r.get("block_h") else ""
        lines.append(f"| {r['kernel']} | {r['arch']} | {r['dtype']} | {int(r['flag'])} | {int(r.get('softcap', 0))} | "
                     f"{r['layout']} | "
                     f"{r['block_n']}×{r['block_v']}{bh}/{r['num_warps']}/{r['num_stages']} | {r['regs']} | {r['spill']} | "
                     f"{r['shared']} | {r['ldg128']} ({r['need128']}) | {r['ldg_narrow']} | {r['warps_per_sm']} | "
                     f"{r['seconds']} | {'ok' if not bad else '; '.join(bad)} |")
    return "\n".join(lines)


def summary(results) -> str:
    n = len(results)
    ok = sum(r["ok"] for r in results)
    spills = sum(1 for r in results if r["ok"] and r["spill"] > 0 and r["dtype"] != "fp64")
    fp64_spills = sum(1 for r in results if r["ok"] and r["spill"] > 0 and r["dtype"] == "fp64")
    aligned = [r for r in results if r["ok"] and r["layout"] in "at"]
    vec = sum(1 for r in aligned if r["ldg128"] >= r["need128"])
    failed = sum(1 for r in results if failures(r))
    return (f"{n} builds, {ok} compiled, {spills} bf16/fp16/fp32 builds spill ({fp64_spills} fp64), "
            f"{vec}/{len(aligned)} aligned builds use 128-bit logits loads, {failed} fail a check")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ci", action="store_true", help="the representative set of the CI test")
    p.add_argument("--stages", action="store_true", help="also build num_stages=2 and compare the SASS")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        return subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:])], env=env).returncode
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default, stated (silences 3.9's warning)
    t0 = time.perf_counter()
    results = run(grid(args.ci, args.stages), args.workers)
    print(table(results))
    print()
    print(summary(results) + f" ({time.perf_counter() - t0:.1f} s)")
    dup = stage_duplicates(results)
    if dup:
        print(f"num_stages=2 builds with the SASS of num_stages=1: {sum(s for _, s in dup)}/{len(dup)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)
    return 1 if any(failures(r) for r in results) else 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    sys.exit(main())
