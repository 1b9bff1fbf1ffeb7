"""Tiny reward models and judges built from configs for the reward-model tests (no downloads):
a sequence-classification reward model trained here, in seconds, to prefer texts holding a
marker character, and an untrained causal-LM judge; both saved as HF folders."""
import random

import torch

MARKER = "!"
_CHARS = "0123456789+=<>abcxyz "


def marker_pairs(rng: random.Random, n: int):
    """(chosen, rejected) texts: a random string with and without the marker inserted."""
    rej = ["".join(rng.choice(_CHARS) for _ in range(rng.randint(3, 20))) for _ in range(n)]
    cho = []
    for r in rej:
        k = rng.randint(0, len(r))
        cho.append(r[:k] + MARKER + r[k:])
    return cho, rej


def marker_rm(tmp_path_factory) -> str:
    """The marker reward model of this test session (trained once, shared by the test modules)."""
    path = tmp_path_factory.getbasetemp() / "marker_rm"
    if not (path / "config.json").exists():
        train_marker_rm(str(path))
    return str(path)


def train_marker_rm(path: str, steps: int = 30, pairs: int = 16, seed: int = 0) -> str:
    """A 1-layer Qwen2ForSequenceClassification (num_labels=1) trained with the Bradley–Terry loss
    −log σ(r(chosen) − r(rejected)) to score texts with the marker higher; saved to `path`."""
    from transformers import AutoModelForSequenceClassification

    from fastgrpo.models.tiny import build_char_tokenizer, save_tiny, tiny_config

    tok = build_char_tokenizer()
    tok.padding_side = "right"
    cfg = tiny_config("qwen2", vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                      head_dim=16, num_labels=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rm = AutoModelForSequenceClassification.from_config(cfg)
    rng = random.Random(seed)
    opt = torch.optim.Adam(rm.parameters(), lr=3e-3)
    for _ in range(steps):
        cho, rej = marker_pairs(rng, pairs)
        s = rm(**tok(cho + rej, padding=True, return_tensors="pt")).logits.squeeze(-1)
        loss = -torch.nn.functional.logsigmoid(s[:pairs] - s[pairs:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_tiny(path, rm.eval(), tok)


def tiny_judge(path: str, seed: int = 0) -> str:
    """An untrained tiny causal LM with the char tokenizer, saved as a judge folder."""
    from fastgrpo.models.tiny import build_tiny_model, save_tiny

    model, tok = build_tiny_model("qwen2", seed=seed, hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                                  head_dim=16)
    return save_tiny(path, model.eval(), tok)
