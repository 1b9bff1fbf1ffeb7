"""The kernels' config choice (kernels/triton/_tune.py) on its GPU path, run on CPU with a fake
kernel in place of the compiled one: tuning never touches the caller's buffers and reads at most
a bounded slice, keys carry the constexpr flags and an N bucket, the choice is deterministic and
cached on disk (a new process does not tune again), a config that fails to compile falls back to
the next one with a warning."""
import json
import warnings

import pytest
import torch
from triton.runtime.errors import OutOfResources

from fastgrpo.kernels.triton import _common, _tune, grpo_loss, logprobs


class FakeKernel:
    """Records every launch: (grid, the data pointers of the tensor args, the config)."""

    def __init__(self, fail=()):
        self.launches = []
        self.fail = set(fail)

    def __getitem__(self, grid):
        def run(*args, BLOCK_N, BLOCK_V, num_warps, num_stages, **consts):
            cfg = _tune.KernelConfig(BLOCK_N, BLOCK_V, num_warps, num_stages)
            if cfg in self.fail:
                raise OutOfResources(300_000, 232_448, "shared memory")
            ptrs = [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            floats = [a for a in args if isinstance(a, float)]
            self.launches.append(dict(grid=grid, ptrs=ptrs, shapes=shapes, cfg=cfg, consts=consts, floats=floats))
        return run


@pytest.fixture
def gpu_path(monkeypatch, tmp_path):
    """The launchers' GPU path with fake kernels, a fake sm_90 device and a cache in tmp_path."""
    monkeypatch.setattr(_common, "INTERPRET", False)
    monkeypatch.setenv("FASTGRPO_EXT_DIR", str(tmp_path / "ext"))
    monkeypatch.setattr(_tune, "_disk", None)
    timings = iter([])
    state = {"bench_calls": 0}

    def bench(fn):
        fn()
        state["bench_calls"] += 1
        return next(timings, 1.0)

    kernels = {}
    for mod, name in ((grpo_loss, "GRPO_LOSS_BWD"), (logprobs, "TOKEN_LOGPROBS_FWD")):
        fake = FakeKernel()
        tk = _tune.TunedKernel(fake, getattr(mod, name).name, bench=bench, device_key=lambda: ("fake-H200@sm90", 9),
                               heavy_flag=getattr(mod, name).heavy_flag)
        monkeypatch.setattr(mod, name, tk)
        kernels[name] = tk
    state["kernels"] = kernels

    def set_timings(seq):
        nonlocal timings
        timings = iter(seq)

    state["set_timings"] = set_timings
    return state


def _bwd_inputs(n=64, v=1024, dtype=torch.bfloat16):
    logits = torch.randn(n, v).to(dtype)
    z = torch.zeros(n)
    return logits, torch.randint(0, v, (n,)), z, z.clone(), z.clone(), z.clone()


def test_backward_tuning_never_writes_or_clones_the_callers_buffer(gpu_path, monkeypatch):
    monkeypatch.setattr(_tune, "TUNE_BYTES", 10 * 1024 * 2)  # a 10-row scratch slice
    logits, tgt, lse, g, h, ent = _bwd_inputs()
    out = grpo_loss.grpo_loss_bwd(logits, tgt, lse, g, h, ent, 1.0, out=logits)  # in place
    assert out is logits
    fake = gpu_path["kernels"]["GRPO_LOSS_BWD"].kernel
    *tuning, real = fake.launches
    assert len(tuning) >= 2 * len(_tune.candidates(_tune.SM90, 1024, "a"))  # warm + timed per config
    for launch in tuning:
        assert launch["ptrs"][1] != logits.data_ptr(), "tuning wrote into the caller's (in-place) buffer"
        assert launch["shapes"][1] == (10, 1024), "tuning must use a bounded scratch slice"
    assert real["ptrs"][1] == logits.data_ptr() and real["shapes"][1] == (64, 1024)
    # The second call with the same key does not tune again.
    n = len(fake.launches)
    grpo_loss.grpo_loss_bwd(logits, tgt, lse, g, h, ent, 1.0, out=logits)
    assert len(fake.launches) == n + 1


def test_soft_capped_backward_tunes_among_fp32_sized_tiles_and_gets_the_cap_at_run_time(gpu_path):
    """HAS_SOFTCAP is register-heavier: bf16 logits get the fp32-sized table (no 32-element tiles,
    which took 151–166 registers or spilled on sm_90); the cap itself is a runtime argument."""
    logits, tgt, lse, g, h, ent = _bwd_inputs(v=4096)
    fake = gpu_path["kernels"]["GRPO_LOSS_BWD"].kernel
    tried = {}
    for cap in (None, 30.0):
        del fake.launches[:]
        grpo_loss.grpo_loss_bwd(logits, tgt, lse, g, h, ent, 1.0, softcap=cap)
        tried[cap] = {launch["cfg"] for launch in fake.launches}
        assert all(launch["consts"]["HAS_SOFTCAP"] == (cap is not None) for launch in fake.launches)
        assert (30.0 in fake.launches[-1]["floats"]) == (cap is not None)  # the real launch: cap as a scalar
    assert tried[None] == set(_tune.candidates(_tune.configs_for(_tune.SM90, 2), 4096, "a"))
    heavy = set(_tune.candidates(_tune.configs_for(_tune.SM90, _tune.HEAVY_MIN_ELEM_BYTES), 4096, "a"))
    assert tried[30.0] == heavy and tried[30.0] != tried[None]
    assert all(c.elems_per_thread() <= 16 for c in heavy)


def test_keys_hold_the_flags_and_an_n_bucket():
    tk = _tune.TunedKernel(None, "k", device_key=lambda: ("dev", 9))
    x = torch.zeros(1, dtype=torch.bfloat16)
    key = lambda consts, n, v=4096, layout="a": tk.key((x,), consts, n, v, layout)  # noqa: E731
    assert key({"HAS_H": True}, 4096) != key({"HAS_H": False}, 4096)
    assert key({"HAS_ENT": True}, 4096) != key({"HAS_ENT": False}, 4096)
    assert key({"HAS_H": True}, 100) != key({"HAS_H": True}, 100_000)
    assert key({"HAS_H": True}, 3000) == key({"HAS_H": True}, 4000)  # one bucket
    assert key({"HAS_H": True}, 4096, 151_936) == key({"HAS_H": True}, 4096, 140_000)  # one V bucket
    assert key({"HAS_H": True}, 4096, layout="a") != key({"HAS_H": True}, 4096, layout="t")
    assert _tune.layout_of(4096, (4096,)) == "a" and _tune.layout_of(151_655, (151_936,)) == "t"
    assert _tune.layout_of(50_257, (50_257,)) == "u"


def test_choice_is_deterministic_cached_on_disk_and_not_retuned_by_a_new_process(gpu_path, tmp_path):
    logits, tgt, lse, g, h, ent = _bwd_inputs(v=4096)
    cands = _tune.candidates(_tune.SM90, 4096, "a")
    # The third config is fastest, the fifth is within the tie margin of it: the earlier wins.
    times = [1.0] * len(cands)
    times[2], times[4] = 0.500, 0.490
    gpu_path["set_timings"](times)
    grpo_loss.grpo_loss_bwd(logits, tgt, lse, g, None, None, 1.0)
    tk = gpu_path["kernels"]["GRPO_LOSS_BWD"]
    assert list(tk.chosen.values()) == [cands[2]]
    files = list((tmp_path / "tune").glob("triton-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert list(saved.values()) == [list(cands[2].as_tuple())] and "HAS_H=0" in next(iter(saved))
    # A fresh process: empty in-memory state, same cache file -> no bench call, same config.
    calls = gpu_path["bench_calls"]
    _tune._disk = None
    fresh = _tune.TunedKernel(FakeKernel(), tk.name, bench=tk.bench, device_key=tk.device_key)
    grpo_loss.GRPO_LOSS_BWD = fresh
    try:
        grpo_loss.grpo_loss_bwd(logits, tgt, lse, g, None, None, 1.0)
    finally:
        grpo_loss.GRPO_LOSS_BWD = tk
    assert gpu_path["bench_calls"] == calls
    assert [launch["cfg"] for launch in fresh.kernel.launches] == [cands[2]]


def test_a_config_that_fails_to_compile_falls_back_to_the_next_with_a_warning(gpu_path):
    tk = gpu_path["kernels"]["TOKEN_LOGPROBS_FWD"]
    cands = _tune.candidates(_tune.configs_for(_tune.SM90, 4), 4096, "a")  # fp32 logits
    logits = torch.randn(8, 4096)
    tgt = torch.randint(0, 4096, (8,))
    _tune._disk_put(tk.key((logits, tgt, torch.empty(0), torch.empty(0), torch.empty(0)), {"HAS_ENT": False, "HAS_SOFTCAP": False, "FP64": False},
                           8, 4096, "a"), cands[0])  # a cached choice that will not compile
    tk.kernel.fail = {cands[0]}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logprobs.token_logprobs_fwd(logits, tgt, 1.0, False)
    assert any("failed at run time" in str(w.message) for w in caught)
    assert [launch["cfg"] for launch in tk.kernel.launches] == [cands[1]]
    # Every config failing: the error surfaces (never a silent no-op).
    tk.kernel.fail = set(cands)
    tk.chosen.clear()
    tk.broken.clear()
    with pytest.raises(OutOfResources), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logprobs.token_logprobs_fwd(logits, tgt, 1.0, False)


def test_wide_dtypes_get_more_warps_per_tile():
    fp32 = _tune.configs_for(_tune.SM90, 4)
    assert _tune.configs_for(_tune.SM90, 2) == _tune.SM90
    assert all(c.block_n * c.block_v * 4 <= _tune.MAX_BYTES_PER_THREAD * 32 * c.num_warps for c in fp32)
    assert _tune.KernelConfig(64, 128, 16) in fp32 and _tune.KernelConfig(1, 4096, 8) in fp32
    assert _tune.KernelConfig(32, 256, 16) not in fp32  # spilled 8 B on sm_90


def test_unaligned_rows_only_get_configs_that_do_not_spill():
    for cfgs in (_tune.SM90, _tune.FALLBACK):
        kept = _tune.candidates(cfgs, 50_257, "u")
        assert kept and all(c.elems_per_thread() <= _tune.UNALIGNED_ELEMS_PER_THREAD and c.block_n <= 2 for c in kept)
        kept32 = _tune.candidates(_tune.configs_for(cfgs, 4), 50_257, "u")
        assert kept32 and all(c.block_n <= 2 for c in kept32)
        assert len(_tune.candidates(cfgs, 50_256, "a")) > len(kept)
        small = _tune.candidates(cfgs, 1000, "u")  # even when no narrow config fits V
        assert all(c.elems_per_thread() <= _tune.UNALIGNED_ELEMS_PER_THREAD for c in small)
