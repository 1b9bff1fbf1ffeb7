"""Fixtures of the rollout-worker tests: one local Ray per test file (module scope: starting Ray
costs ~10 s here), shut down after the file; a tiny async config (1-layer hidden-32 model,
4 prompts × G = 4, 8-token completions)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

from trainer_helpers import TINY  # noqa: E402

ASYNC = ["rollout.mode=async", "sync.timeout=300", "cluster.object_store_mb=100"]


def async_cfg(tmp_path, *extra):
    from fastgrpo.config import load_config

    return load_config(None, TINY + ASYNC + [f"logging.out_dir={tmp_path}"] + list(extra))


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    # 4 logical CPUs on 2 cores: a test may start a worker while a module-wide pool holds two
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, configure_logging=False)
    yield ray
    ray.shutdown()
