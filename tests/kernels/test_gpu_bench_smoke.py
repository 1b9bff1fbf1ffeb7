"""The GPU benchmark scripts in --cpu-smoke mode (interpreter, tiny sizes): every code path of
benchmarks/bench_gpu_kernels.py and bench_gpu_fused_linear.py runs, including their oracle
checks, so the GPU suite does not crash on first real use. Timings here mean nothing."""
import csv
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_gpu_fused_linear, bench_gpu_kernels, gpu_warmup

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _smoke(module, args, capsys):
    """In process on CPU machines (the interpreter flag is already set); on a GPU machine in a
    child with CUDA hidden and the interpreter on, since this process compiles real kernels."""
    if not torch.cuda.is_available():
        module.main(["--cpu-smoke", *args])
        return capsys.readouterr().out
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    script = os.path.join(ROOT, "benchmarks", module.__name__.split(".")[-1] + ".py")
    done = subprocess.run([sys.executable, script, "--cpu-smoke", *args], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_loss_kernel_bench_smoke(tmp_path, capsys):
    out = tmp_path / "k.csv"
    printed = _smoke(bench_gpu_kernels, ["--ns", "64", "--vs", "100", "--csv", str(out)], capsys)
    assert "N=70001 V=5 bfloat16 grad: ok" in printed  # the > 65 535-row oracle check ran
    cases = {r["case"] for r in _rows(out)}
    assert {"fastgrpo kernel fwd", "fastgrpo kernel bwd", "fastgrpo fwd", "fastgrpo fwd+bwd",
            "fastgrpo bwd (fwd+bwd − fwd)", "trl fwd+bwd"} <= cases
    assert all(float(r["median_ms"]) > 0 for r in _rows(out))


def test_fused_linear_bench_smoke(tmp_path, capsys):
    out = tmp_path / "f.csv"
    printed = _smoke(bench_gpu_fused_linear, ["--ns", "48", "--vs", "100", "--hidden", "16", "--csv", str(out)],
                     capsys)
    # loss, d_hidden, d_weight for token and sequence ratio, chunked path and single kernel (cce)
    assert printed.count(": ok (") == 12 and sum(line.startswith("cce ") for line in printed.splitlines()) == 6
    rows = {r["case"]: r for r in _rows(out)}
    assert float(rows["bare matmuls (logits + dH + dW) fwd+bwd"]["vs_matmuls"]) == 1.0
    assert "fastgrpo fused sequence-ratio fwd+bwd" in rows and "fastgrpo cce single kernel token-ratio fwd+bwd" in rows


def test_fp16_oracle_check_smoke(capsys):
    printed = _smoke(bench_gpu_kernels, ["--check-only", "--dtype", "fp16"], capsys)  # KeyError before
    assert "float16 grad: ok" in printed and "FAIL" not in printed


def test_warmup_smoke(capsys):
    printed = _smoke(gpu_warmup, [], capsys)
    assert "warm-up: " in printed and ", 0 failed" in printed


def test_suite_limits_fit_ten_minutes():
    import re

    with open(os.path.join(ROOT, "benchmarks", "gpu_suite.sh")) as f:
        text = f.read()
    limits = [int(x) for x in re.findall(r"GPU_SUITE_T_[A-Z]+:-(\d+)", text)]
    assert len(limits) == 5 and sum(limits) <= 570, limits  # + ~30 s of start-up within 600 s
    assert "gpu_warmup.py" in text


def test_suite_script_is_valid_bash():
    script = os.path.join(ROOT, "benchmarks", "gpu_suite.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
