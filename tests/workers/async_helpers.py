"""The tiny async config of the rollout-worker tests (1-layer hidden-32 model, 4 prompts × G = 4,
8-token completions), in a module of its own: `from conftest import` would find another
directory's conftest when pytest collects several test folders."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

from trainer_helpers import TINY  # noqa: E402

ASYNC = ["rollout.mode=async", "sync.timeout=300", "cluster.object_store_mb=100"]


def async_cfg(tmp_path, *extra):
    from fastgrpo.config import load_config

    return load_config(None, TINY + ASYNC + [f"logging.out_dir={tmp_path}"] + list(extra))
