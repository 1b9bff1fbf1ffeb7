"""fastgrpo.native.allocator: glibc malloc keeps freed activation buffers for reuse."""
import platform
import tempfile

import pytest

from fastgrpo.native import allocator


def test_off_switch(monkeypatch):
    monkeypatch.setenv("FASTGRPO_MALLOC_TUNE", "0")
    assert allocator.tune_host_allocator() is False
    monkeypatch.setenv("FASTGRPO_MALLOC_TUNE", "perhaps")
    with pytest.raises(ValueError, match="FASTGRPO_MALLOC_TUNE"):
        allocator.tune_host_allocator()


def test_applies_on_glibc(monkeypatch):
    monkeypatch.setenv("FASTGRPO_MALLOC_TUNE", "1")
    libc, _ = platform.libc_ver()
    # mallopt returns 1 for each accepted setting on glibc (the CI machines); elsewhere nothing is done
    assert allocator.tune_host_allocator() is (libc == "glibc")


def test_the_trainer_applies_it(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "tune_host_allocator", lambda: calls.append(1) or True)
    from fastgrpo.config import load_config
    from fastgrpo.trainer.grpo import Trainer

    cfg = load_config(overrides=["rollout.engine=torch", "logging.tensorboard=false", "logging.plots=false",
                                 "logging.progress=false", "checkpoint.resume=none", "checkpoint.at_end=false"])
    with tempfile.TemporaryDirectory() as d:
        cfg.logging.out_dir = d
        t = Trainer(cfg, log=lambda *_: None)
        t.close()
    assert calls == [1]
