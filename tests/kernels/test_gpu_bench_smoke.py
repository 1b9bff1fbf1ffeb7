"""The GPU benchmark scripts in --cpu-smoke mode (interpreter, tiny sizes): every code path of
benchmarks/bench_gpu_kernels.py and bench_gpu_fused_linear.py runs, including their oracle
checks, so the GPU suite does not crash on first real use. Timings here mean nothing."""
import csv
import os
import subprocess

import pytest

from benchmarks import bench_gpu_fused_linear, bench_gpu_kernels

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_loss_kernel_bench_smoke(tmp_path, capsys):
    out = tmp_path / "k.csv"
    bench_gpu_kernels.main(["--cpu-smoke", "--ns", "64", "--vs", "100", "--csv", str(out)])
    printed = capsys.readouterr().out
    assert "N=70001 V=5 bfloat16 grad: ok" in printed  # the > 65 535-row oracle check ran
    cases = {r["case"] for r in _rows(out)}
    assert {"fastgrpo kernel fwd", "fastgrpo kernel bwd", "fastgrpo fwd", "fastgrpo fwd+bwd", "fastgrpo bwd",
            "trl fwd+bwd"} <= cases
    assert all(float(r["median_ms"]) > 0 for r in _rows(out))


def test_fused_linear_bench_smoke(tmp_path, capsys):
    out = tmp_path / "f.csv"
    bench_gpu_fused_linear.main(["--cpu-smoke", "--ns", "48", "--vs", "100", "--hidden", "16", "--csv", str(out)])
    printed = capsys.readouterr().out
    assert printed.count(": ok (") == 6  # loss, d_hidden, d_weight for token and sequence ratio
    rows = {r["case"]: r for r in _rows(out)}
    assert float(rows["bare matmuls (logits + dH + dW) fwd+bwd"]["vs_matmuls"]) == 1.0
    assert "fastgrpo fused sequence-ratio fwd+bwd" in rows


def test_suite_script_is_valid_bash():
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "benchmarks", "gpu_suite.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
