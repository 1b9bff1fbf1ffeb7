"""Fixtures of the trainer tests (helpers live in trainer_helpers.py)."""
import random

import pytest
from trainer_helpers import tiny_cfg


@pytest.fixture
def cfg_factory(tmp_path):
    random.seed(0)
    return lambda *extra: tiny_cfg(tmp_path, *extra)
