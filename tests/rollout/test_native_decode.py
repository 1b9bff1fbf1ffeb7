"""The native decode step (csrc/jit/decode_step.cpp) against LeanStepper's Python step:
same logits and caches step after step (Qwen2 with q/k/v biases, Llama without; GQA 2:1, 4:2 and
none; left padding; rows dropped midway), same rollouts through the engine, and every way of
not having it (switched off, more than one thread, a failed build) leaves the Python step."""
import os
import warnings

import pytest
import torch

from fastgrpo.models.tiny import build_tiny_model
from fastgrpo.rollout import SamplingConfig
from fastgrpo.native import decode_step as _native
from fastgrpo.rollout.decoders import LeanStepper
from fastgrpo.rollout.torch_engine import TorchEngine
from rollout_oracle import check_engine, check_fp32, decode_depth, float64_copy, fp32_tol


# one thread: the engine's choice for steps this small, and the native step's condition
pytestmark = pytest.mark.usefixtures("one_thread")


def test_it_builds_here():
    # the CI machine has a compiler: a silent fallback there would leave the native step untested
    assert _native.decode_step_module() is not None


def _model(arch, heads, kv_heads, head_dim, seed=0, hidden=64):
    model, tok = build_tiny_model(arch, seed=seed, hidden_size=hidden, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=96)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in model.parameters():  # off the flat random init: varied, prompt-dependent logits
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval(), tok


def _steppers(model, B=6, W=7, budget=20):
    ids = torch.randint(3, 40, (B, W), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(B, W, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[3, :1] = 0
    out = []
    for native in (True, False):
        res = model(input_ids=ids, attention_mask=mask, use_cache=True)
        out.append(LeanStepper(model, res.past_key_values, mask, budget, native=native))
    return out, (mask.cumsum(-1)[:, -1]).clone()


@pytest.mark.parametrize("arch,heads,kv,head_dim", [("qwen2", 2, 1, 32), ("llama", 4, 2, 16), ("qwen2", 2, 2, 32),
                                                    ("llama", 1, 1, 64)])
def test_native_step_equals_python_step(arch, heads, kv, head_dim):
    """Both float32 steps against the Python step in float64, step after step, logits and caches:
    the native one is as close to it as the Python one (they differ only in float32 rounding),
    within the float32 bound of rollout_oracle (rms over the step, so on any CPU; neither drifts:
    every step is held to it)."""
    model, _ = _model(arch, heads, kv, head_dim)
    exact = float64_copy(model)
    with torch.inference_mode():
        (nat, py), pos = _steppers(model)
        ref = _steppers(exact)[0][1]
        assert nat.native is not None and py.native is None and ref.native is None
        gen = torch.Generator().manual_seed(2)
        rows = torch.arange(6)
        width = nat.width
        depth = decode_depth(model.config, width + 12)
        for t in range(12):
            ids = torch.randint(3, 40, (len(rows),), generator=gen)
            a, b, r = nat.step(ids, pos, t), py.step(ids, pos, t), ref.step(ids, pos, t)
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == r.shape
            check_fp32(f"step {t} logits", a, b, r, fp32_tol(depth, r))
            n = width + t + 1  # the cache written so far (the prefill's, pads included, and t + 1 steps)
            for i in range(len(nat.k)):  # the native step keeps K transposed
                for what, got, want, truth in (("K", nat.k[i].transpose(2, 3), py.k[i], ref.k[i]),
                                               ("V", nat.v[i], py.v[i], ref.v[i])):
                    truth = truth[:, :, :n]
                    check_fp32(f"step {t} layer {i} {what} cache", got[:, :, :n], want[:, :, :n], truth,
                               fp32_tol(depth, truth))
            pos = pos + 1
            if t == 5:  # rows finish: all drop them
                keep = torch.tensor([0, 2, 3, 5])
                nat.select(keep), py.select(keep), ref.select(keep)
                pos, rows = pos[keep], rows[keep]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_engine_rollouts_match_the_python_step(arch):
    """The engine on the native step + sampler and on the Python step + `pick`: each completion's
    tokens are the float64 model's draws for its seed's uniforms and its log-probs float32-close
    to float64's (rollout_oracle.check_engine); so the two engines' rollouts are the same up to a
    draw float64 puts within rounding of a CDF boundary (here they are identical)."""
    model, tok = _model(arch, 2, 1, 32, seed=3)
    prompts = ["1+2=", "12*34-5=", "a", "(7+8)*9="]
    sp = SamplingConfig(temperature=0.9, max_new_tokens=24, seed=5)
    nat = TorchEngine(model, tok, decoder="auto").generate(prompts, 4, sp)
    py = TorchEngine(model, tok, decoder="lean").generate(prompts, 4, sp)
    exact = float64_copy(model)
    for name, out in (("native", nat), ("python", py)):
        check_engine(name, model, tok, prompts, out, sp, exact)


def test_when_the_python_step_is_used(monkeypatch):
    model, _ = _model("qwen2", 2, 1, 32)
    with torch.inference_mode():
        monkeypatch.setenv("FASTGRPO_NATIVE_DECODE", "0")
        assert _steppers(model)[0][0].native is None
        monkeypatch.setenv("FASTGRPO_NATIVE_DECODE", "1")
        torch.set_num_threads(2)  # multi-threaded steps stay on MKL's threaded GEMMs
        assert _steppers(model)[0][0].native is None
        torch.set_num_threads(1)
        assert _steppers(model)[0][0].native is not None
        bf16 = _model("qwen2", 2, 1, 32)[0].to(torch.bfloat16)
        assert _steppers(bf16)[0][0].native is None
    monkeypatch.setenv("FASTGRPO_NATIVE_DECODE", "maybe")
    with pytest.raises(ValueError, match="FASTGRPO_NATIVE_DECODE"):
        _native.enabled()


@pytest.fixture
def reload_native():
    """`decode_step_module()` loads afresh inside the test, and the cached module is back after."""
    assert _native.decode_step_module() is not None
    _native._load.cache_clear()
    yield
    _native._load.cache_clear()


def test_a_failed_build_warns_and_falls_back(monkeypatch, tmp_path, reload_native):
    bad = tmp_path / "decode_step.cpp"
    bad.write_text("this is not C++\n")
    monkeypatch.setattr(_native, "sources", lambda: [str(bad)])
    monkeypatch.setenv("FASTGRPO_EXT_DIR", str(tmp_path / "ext"))
    with pytest.warns(RuntimeWarning, match="native decode step could not be built"):
        assert _native.decode_step_module() is None


def test_a_stale_lock_from_a_killed_build_does_not_hang(reload_native):
    """torch's own build lock, left behind by a build killed midway, would make every later build
    wait forever; the loader clears it under its own flock."""
    lock = os.path.join(_native.build_dir(), "lock")
    open(lock, "w").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.decode_step_module() is not None
    assert not os.path.exists(lock)


def test_large_vocabulary_takes_the_library_gemm_and_agrees():
    """An lm_head past an L2's worth of floats goes to at::mm inside the native step (the blocked
    loop would stream it once per 4 rows): as close to the float64 step's logits as the Python
    step's."""
    model, _ = build_tiny_model("qwen2", seed=1, vocab_size=6000, hidden_size=64, num_attention_heads=2,
                                num_key_value_heads=1, head_dim=32)
    model.eval()
    assert model.lm_head.weight.numel() > 1 << 18
    with torch.inference_mode():
        (nat, py), pos = _steppers(model)
        ref = _steppers(float64_copy(model))[0][1]
        ids = torch.randint(3, 40, (6,), generator=torch.Generator().manual_seed(0))
        r = ref.step(ids, pos, 0)
        check_fp32("logits", nat.step(ids, pos, 0), py.step(ids, pos, 0), r,
                   fp32_tol(decode_depth(model.config, nat.width + 1), r))


def test_native_step_refuses_bad_layouts():
    """The loops index raw memory: a cache that is not the contiguous layout they expect, or a
    position past the RoPE table, is an error, not a stray read."""
    model, _ = _model("qwen2", 2, 1, 32)
    with torch.inference_mode():
        (nat, _), pos = _steppers(model)
        ids = torch.randint(3, 40, (6,))
        good_k = nat.k[0]
        nat.k[0] = good_k.transpose(2, 3)  # the Python layout, not the native one
        with pytest.raises(RuntimeError, match="caches must be contiguous"):
            nat.step(ids, pos, 0)
        nat.k[0] = good_k
        with pytest.raises(RuntimeError, match="outside the RoPE table"):
            nat.step(ids, pos + 10_000, 0)
        with pytest.raises(RuntimeError, match="outside the cache"):
            nat.step(ids, pos, 10_000)
        good_norm = nat._norm_w
        nat._norm_w = good_norm[:1]  # a broadcastable weight would be read past its end
        with pytest.raises(RuntimeError, match="final norm weight of 1 for hidden 64"):
            nat.step(ids, pos, 0)
        nat._norm_w = good_norm
        assert torch.isfinite(nat.step(ids, pos, 0)).all()


def test_a_held_build_lock_times_out_into_the_python_step(monkeypatch, reload_native):
    """Another process stuck holding the build lock: the wait ends with a warning and the
    Python step, never a hang."""
    import fcntl

    monkeypatch.setattr(_native, "LOCK_TIMEOUT_S", 0.5)
    with open(os.path.join(_native.build_dir(), ".fastgrpo.lock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: conflicts like another process
        with pytest.warns(RuntimeWarning, match="locked by another build"):
            assert _native.decode_step_module() is None


def test_ninja_from_the_venv_when_path_has_none(monkeypatch):
    """`.venv/bin/python -m pytest` without an activated venv: PATH lacks the wheel's ninja, and
    torch's build would fail for want of it; the loader puts the wheel's folder on PATH."""
    import shutil

    import ninja

    from fastgrpo import env

    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    env.ninja_on_path()
    assert os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR
    assert shutil.which("ninja") is not None
    env.ninja_on_path()  # idempotent: found now, PATH untouched
    assert os.environ["PATH"].count(ninja.BIN_DIR) == 1


@pytest.mark.parametrize("arch,heads,kv,head_dim", [("qwen2", 2, 1, 32), ("llama", 4, 2, 16)])
def test_native_prefill_equals_the_hf_forward(arch, heads, kv, head_dim):
    """LeanStepper.native_prefill (the prompt fed a position at a time through the native step,
    left-pad queries attending to nothing) against the HF forward the engine otherwise runs, both
    next to the float64 HF forward: the last logits, the cache on the real positions, and the
    next step."""
    model, _ = _model(arch, heads, kv, head_dim)
    exact = float64_copy(model)
    B, W = 5, 9
    ids = torch.randint(3, 40, (B, W), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(B, W, dtype=torch.long)
    mask[0, :6] = 0  # a short prompt: six pads
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    depth = decode_depth(model.config, W + 1)
    with torch.inference_mode():
        nat, logits = LeanStepper.native_prefill(model, ids, mask, 6)
        res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        res64 = exact(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        ref = LeanStepper(model, res.past_key_values, mask, 6, native=True)
        ref64 = LeanStepper(exact, res64.past_key_values, mask, 6)
        assert torch.isfinite(logits).all()
        truth = res64.logits[:, -1]
        check_fp32("prefill logits", logits, res.logits[:, -1].float(), truth, fp32_tol(depth, truth))
        real = mask.bool()
        for i in range(len(nat.k)):
            assert torch.isfinite(nat.k[i]).all() and torch.isfinite(nat.v[i]).all()  # pads too
            k_nat, k_ref = nat.k[i].transpose(2, 3)[:, :, :W], ref.k[i].transpose(2, 3)[:, :, :W]
            for what, got, want, truth in (("K", k_nat, k_ref, ref64.k[i][:, :, :W]),
                                           ("V", nat.v[i][:, :, :W], ref.v[i][:, :, :W], ref64.v[i][:, :, :W])):
                truth = truth.permute(0, 2, 1, 3)[real]
                check_fp32(f"layer {i} {what} cache", got.permute(0, 2, 1, 3)[real], want.permute(0, 2, 1, 3)[real],
                           truth, fp32_tol(depth, truth))
        nxt = logits.argmax(-1)
        r = ref64.step(nxt, pos[:, -1] + 1, 0)
        check_fp32("next step", nat.step(nxt, pos[:, -1] + 1, 0), ref.step(nxt, pos[:, -1] + 1, 0), r,
                   fp32_tol(depth, r))
        torch.set_num_threads(2)  # no native step: the caller runs the HF forward
        assert LeanStepper.native_prefill(model, ids, mask, 6) is None


def test_the_wheels_ninja_goes_before_a_system_ninja_on_path(monkeypatch, tmp_path):
    """A system ninja of another version first on PATH would share the build folders with the
    wheel's and each would rebuild what the other built (different .ninja_log formats): the wheel's
    binary is put first."""
    import shutil

    import ninja

    from fastgrpo import env

    other = tmp_path / "bin"
    other.mkdir()
    fake = other / "ninja"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(other))
    assert shutil.which("ninja") == str(fake)
    env.ninja_on_path()
    assert os.path.realpath(shutil.which("ninja")) == os.path.realpath(os.path.join(ninja.BIN_DIR, "ninja"))
