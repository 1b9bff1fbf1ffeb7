import pytest
import torch


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test (restored after)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
