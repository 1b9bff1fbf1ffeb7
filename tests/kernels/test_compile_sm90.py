"""The Triton kernels compiled for Hopper (sm_90) and the fallback GPUs (sm_80) with Triton's
bundled ptxas on this CPU machine, and their SASS read (benchmarks/compile_grid.py): every build
compiles, bf16 / fp16 / fp32 builds do not spill, aligned builds (also with an odd V, whose tail
is peeled) load the logits with 128-bit vector loads, registers and shared memory leave at least
16 resident warps per SM (8 for the fused lm_head kernels of impl="cce"). The CI set (~50
builds, ~2 min cold on the shared 2 cores, seconds with Triton's cache) covers every Hopper
config of the backward kernel, with and without the logit soft cap (HAS_SOFTCAP), and the cce
kernels in bf16 and fp32; `python benchmarks/compile_grid.py` runs the whole grid.

Compilation needs TRITON_INTERPRET unset while tests/conftest.py sets it for the rest of the
suite (and the kernel modules read it at import), so the grid runs in a child process."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import compile_grid  # noqa: E402


def _have_ptxas() -> bool:
    try:
        return os.path.isfile(compile_grid._tool("ptxas"))
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _have_ptxas(), reason="Triton's NVIDIA backend (bundled ptxas) is not installed")


@pytest.fixture(scope="module")
def ci_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("compile") / "ci.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "compile_grid.py"), "--ci",
                           "--workers", "2", "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), done


def test_every_ci_build_passes_the_checks(ci_results):
    results, done = ci_results
    bad = {f"{r['kernel']} sm{r['arch']} {r['dtype']} flag={r['flag']} {r['layout']} "
           f"{r['block_n']}x{r['block_v']}/{r['num_warps']}": compile_grid.failures(r)
           for r in results if compile_grid.failures(r)}
    assert not bad, bad
    assert done.returncode == 0, done.stdout[-2000:]


def test_the_ci_set_is_representative(ci_results):
    from fastgrpo.kernels.triton import _tune

    results, _ = ci_results
    def bwd90(softcap):
        return {(r["block_n"], r["block_v"], r["num_warps"]) for r in results if r["kernel"] == "bwd"
                and r["arch"] == 90 and r["dtype"] == "bf16" and r["layout"] == "a" and r["softcap"] == softcap}

    assert bwd90(False) == {(c.block_n, c.block_v, c.num_warps) for c in _tune.SM90}
    # HAS_SOFTCAP: every Hopper config of the capped backward (sized as for fp32), fp32 extremes, cce
    assert bwd90(True) == {(c.block_n, c.block_v, c.num_warps)
                           for c in _tune.configs_for(_tune.SM90, _tune.HEAVY_MIN_ELEM_BYTES)}
    assert {r["kernel"] for r in results if r["softcap"]} == {"fwd", "bwd", "cce_fwd", "cce_bwd"}
    assert {r["kernel"] for r in results} == {"fwd", "bwd", "cce_fwd", "cce_bwd"}
    assert {r["arch"] for r in results} == {80, 90}
    assert {r["dtype"] for r in results} == {"bf16", "fp16", "fp32", "fp64"}
    assert {r["layout"] for r in results} == {"a", "t", "u"}
    # the odd-V layout keeps its 128-bit loads thanks to the peeled tail
    assert all(r["ldg128"] >= r["need128"] for r in results if r["layout"] == "t")


def test_spill_and_vector_checks_catch_bad_builds():
    """The checks themselves, on made-up results (a check that passes everything proves nothing)."""
    good = dict(ok=True, kernel="bwd", dtype="bf16", layout="a", spill=0, ldg128=4, need128=4, warps_per_sm=16, regs=128, shared=0)
    assert compile_grid.failures(good) == []
    assert compile_grid.failures(dict(good, spill=624)) == ["spills 624 B"]
    assert compile_grid.failures(dict(good, dtype="fp64", spill=624)) == []
    assert "LDG.E.128" in compile_grid.failures(dict(good, ldg128=0))[0]
    assert compile_grid.failures(dict(good, layout="u", ldg128=0)) == []
    assert "warps/SM" in compile_grid.failures(dict(good, warps_per_sm=8))[0]
    assert compile_grid.failures(dict(good, kernel="cce_bwd", warps_per_sm=8)) == []  # one 8-warp matmul CTA
    assert compile_grid.failures(dict(ok=False, error="PTXASError: x"))[0].startswith("compile:")
    assert compile_grid._resident_warps(90, 128, 0, 8) == 16 and compile_grid._resident_warps(90, 255, 0, 4) == 8
