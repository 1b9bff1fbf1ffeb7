"""Test-wide setup. Triton kernels run under its interpreter on machines without a GPU: the
flag must be set before any kernel module is imported, so it is set here, first."""
import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # torch missing is reported by the tests that need it
    _has_cuda = False

if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
