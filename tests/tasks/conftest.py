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
def smol_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)
