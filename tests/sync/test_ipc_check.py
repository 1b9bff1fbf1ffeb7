"""The two-process bucket transfer check (benchmarks/gpu_ipc_check.py) through its CPU twin:
shared memory instead of CUDA IPC, same planning, double buffering and bit-exact verification."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_ipc_check.py")


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--mib", "4", "--bucket-mib", "1",
                           "--repeats", "1", *args], capture_output=True, text=True, timeout=120, env=env)


def test_two_process_transfer_is_bit_exact():
    out = _run()
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("gpu_ipc_check: OK") and "GB/s=" in line, line
    assert int(line.split("buckets=")[1].split()[0]) > 10


def test_a_flipped_byte_fails_the_check():
    out = _run("--corrupt")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MISMATCH" in out.stdout and "model.embed_tokens.weight" in out.stdout
