"""GPU-only paths of the weight sync, checked on CPU: the per-parameter by-value path with a
tensor that claims a non-CPU device (its `.numpy()` refuses, as a CUDA tensor's does), the
check that every tensor-parallel worker answered the same, and the CUDA-IPC mapping of each
worker onto the GPU that holds the buffers (by UUID, not the worker's current device)."""
import pytest
import torch

from fastgrpo.sync import cuda_ipc
from fastgrpo.sync.sender import merge_worker_results, sync_per_parameter


class FakeCudaTensor(torch.Tensor):
    """Behaves like a CUDA tensor where it matters here: `.numpy()` raises the TypeError torch
    raises for a CUDA tensor; `.cpu()` gives a plain host tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        if func is torch.Tensor.cpu:
            return args[0].as_subclass(torch.Tensor).clone()
        return super().__torch_function__(func, types, args, kwargs or {})


def test_per_parameter_by_value_copies_a_device_tensor_to_the_host_first():
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    fake = w.clone().as_subclass(FakeCudaTensor)
    with pytest.raises(TypeError, match="cuda"):
        fake.numpy()
    calls = []

    def rpc(method, *args):
        calls.append((method, args))
        return [] if method == "fastgrpo_finish" else 1

    stats = sync_per_parameter(rpc, [("w", fake)], dtype=torch.bfloat16, by_value=True)
    (method, (items,)), finish = calls
    assert method == "fastgrpo_load_named" and finish[0] == "fastgrpo_finish"
    name, (dtype, shape, data), _, _ = items[0]
    assert name == "w" and dtype == "bfloat16" and shape == [2, 3] and isinstance(data, bytes)
    got = torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(2, 3)
    assert torch.equal(got, w.to(torch.bfloat16)) and stats.nbytes == 12


def test_every_worker_result_is_checked():
    assert merge_worker_results("fastgrpo_load_bucket", [3, 3, 3, 3]) == 3
    assert merge_worker_results("fastgrpo_finish", [[], []]) == []
    with pytest.raises(RuntimeError, match="worker 1 returned \\['a.weight'\\]"):
        merge_worker_results("fastgrpo_finish", [[], ["a.weight"]])
    with pytest.raises(RuntimeError, match="no engine worker"):
        merge_worker_results("fastgrpo_finish", [])


def test_ipc_handles_open_on_the_gpu_that_holds_them(monkeypatch):
    # A worker process sees GPUs [B, A] (its own first); the trainer's buffers live on A.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_ipc, "device_uuid", lambda i: ["GPU-B", "GPU-A"][i])
    opened = []

    def rebuild(*args):
        opened.append(args[cuda_ipc._DEVICE_ARG])
        return args

    args = tuple(range(10))
    payload = {"kind": "cuda_ipc", "handles": [(rebuild, args), (rebuild, args)], "nbytes": 8, "pid": 1,
               "device_uuid": "GPU-A"}
    cuda_ipc.attach(payload)
    assert opened == [1, 1], "the handle must be opened on the ordinal of the trainer's GPU, not the current one"
    with pytest.raises(ValueError, match="device_uuid=GPU-C"):
        cuda_ipc.attach(dict(payload, device_uuid="GPU-C"))
