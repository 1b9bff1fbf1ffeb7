"""Fixtures of the rollout-worker tests: one local Ray per test file (module scope: starting Ray
costs ~10 s here), shut down after the file. The tiny async config: async_helpers.py."""
import pytest


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    # 4 logical CPUs on 2 cores: a test may start a worker while a module-wide pool holds two
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 << 20, configure_logging=False)
    yield ray
    ray.shutdown()
