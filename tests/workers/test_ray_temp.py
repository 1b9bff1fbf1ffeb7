"""A local Ray's session folder stays inside the run (fastgrpo.workers.cluster.ray_temp_dir): every
async run left a `/tmp/ray/session_*` behind (issue 34). Ray is not started here: where it would
write is decided before ray.init; tests/workers/test_async_demo.py checks a real run end to end."""
import os
import shutil
import tempfile

from fastgrpo.config import load_config
from fastgrpo.workers import cluster


def test_ray_session_folder_goes_under_the_run_temp_folder_or_a_private_one(monkeypatch):
    short = tempfile.mkdtemp(dir="/tmp")  # /tmp/tmpXXXXXXXX: room for Ray's 107-byte socket paths
    said = []
    try:
        cfg = load_config(None, [f"logging.out_dir={short}"])
        with monkeypatch.context() as m:  # inside the run: its temp folder is the process's (runs.folder.run_tmpdir)
            m.setattr(tempfile, "tempdir", os.path.join(short, "tmp"))
            assert cluster.ray_temp_dir(cfg, said.append) == os.path.join(short, "tmp", "ray") and not said
        long_run = os.path.join(short, "a-run-folder-whose-path-leaves-no-room-for-rays-sockets")
        cfg = load_config(None, [f"logging.out_dir={long_run}"])
        with monkeypatch.context() as m:
            m.setattr(tempfile, "tempdir", os.path.join(long_run, "tmp"))
            own = cluster.ray_temp_dir(cfg, said.append)
            assert own.startswith("/tmp/fastgrpo-ray-") and os.path.isdir(own)
            assert len(own.encode()) + cluster._RAY_SOCKET_TAIL <= 107
            assert said and f"Ray's session folder: {own}, not {long_run}/tmp/ray" in said[0]
            os.makedirs(os.path.join(own, "session_x", "sockets"))  # what Ray writes there
            cluster.stop_ray()  # Ray not started here: only the folder goes
            assert not os.path.exists(own) and cluster._OWN_TEMP is None
        assert cluster.ray_temp_dir(cfg, said.append) in (None, "/tmp/ray")  # outside a run: Ray's default
    finally:
        shutil.rmtree(short, ignore_errors=True)
