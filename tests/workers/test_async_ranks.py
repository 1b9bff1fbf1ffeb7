"""Two trainer ranks (torchrun, gloo, DDP) with an async rollout worker: rank 0 drives the worker
and shards each batch; both ranks end with identical weights, staleness stays within η. Runs
under a hard timeout, killed as a process group (a hung collective never hangs CI)."""
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_async_ranks.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_trainer_ranks_with_an_async_worker(tmp_path):
    pytest.importorskip("ray")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           RANK, str(tmp_path)]
    proc = subprocess.Popen(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"timed out:\n{log[-3000:]}")
    assert proc.returncode == 0, log[-4000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert (r0["world"], r1["world"]) == (2, 2)
    assert torch.equal(r0["weights"], r1["weights"])
    assert [m["async/version"] for m in r0["logs"]] == [1, 2, 3]
    assert max(m["async/staleness_max"] for m in r0["logs"]) <= 1
    # every rank trained its own half of each batch
    assert len(r0["trained"]) == len(r1["trained"]) == 3 * 4 // 2
    assert sorted(r0["trained"] + r1["trained"]) == list(range(12))
