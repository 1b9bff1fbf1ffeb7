"""Bad input on the Triton path raises the same ValueError, naming the same argument, as the
CPU path (the facade validates before any backend runs; the kernels never see such input)."""
import pytest
import torch

from fastgrpo.loss import grpo_loss

N, V = 6, 37


def _ok():
    g = torch.Generator().manual_seed(0)
    return dict(logits=torch.randn(N, V, generator=g), targets=torch.randint(0, V, (N,), generator=g),
                advantages=torch.randn(N, generator=g))


BAD = {
    "int logits": dict(logits=torch.zeros(N, V, dtype=torch.int32)),
    "3-D logits": dict(logits=torch.zeros(1, N, V)),
    "float targets": dict(targets=torch.zeros(N)),
    "targets out of range": dict(targets=torch.full((N,), V)),
    "short advantages": dict(advantages=torch.zeros(N - 1)),
    "NaN logits": dict(logits=torch.full((N, V), float("nan"))),
}


def _error(impl, case, extra=None):
    kw = dict(_ok(), **BAD[case])
    with pytest.raises(ValueError) as e:
        grpo_loss(kw.pop("logits"), kw.pop("targets"), kw.pop("advantages"), impl=impl, **(extra or {}))
    return str(e.value)


@pytest.mark.parametrize("case", list(BAD))
def test_same_value_error_as_the_cpu_path(case):
    cpu, gpu = _error("torch", case), _error("triton", case)
    assert cpu == gpu
    assert cpu.split(":")[0].split("=")[0] in ("logits", "targets", "advantages"), cpu


def test_cu_seqlens_not_covering_n():
    kw = _ok()
    msgs = []
    for impl in ("torch", "triton"):
        with pytest.raises(ValueError) as e:
            grpo_loss(kw["logits"], kw["targets"], kw["advantages"], cu_seqlens=torch.tensor([0, 2, N - 1]), impl=impl)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "cu_seqlens" in msgs[0]
