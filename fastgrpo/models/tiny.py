"""Tiny models and a character-level tokenizer built locally (no downloads).

Used by the embedded demo (`fastgrpo train` with no arguments), by tests and by benchmarks.
The tokenizer is a `tokenizers` WordLevel model over single characters, wrapped in
transformers' PreTrainedTokenizerFast so that HF models, `save_pretrained` / `from_pretrained`
and vLLM load it like any hub tokenizer. The reasoning tags are single tokens so that a tiny
model learns the format in a few SFT steps.
"""
from __future__ import annotations

import os
import string
from typing import Sequence, Tuple

import torch

PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# digits first: the arithmetic demo mostly emits them, and low ids keep the vocab readable
CHARS = string.digits + string.ascii_letters + " +-*/=()<>.,:;!?'\"[]{}_^%$#@&|~`\\\n"


def build_char_tokenizer(extra_chars: str = "", extra_tokens: Sequence[str] = ()):
    """Character-level PreTrainedTokenizerFast: ids 0..2 are <pad>, <eos>, <bos>, then the four
    reasoning tags, then one id per character, then `<unk>` (unknown characters map to it
    instead of raising, so hostile text still tokenizes), then `extra_tokens`, each a single
    token after every id of the default vocabulary (the tool demo's `<tool_call>` …: the default
    demo's ids stay as they are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab(extra_chars, extra_tokens)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Split into single characters (the tags are matched first as added tokens).
    tk.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                  unk_token="<unk>", clean_up_tokenization_spaces=False)
    tok.add_tokens(list(TAGS) + list(extra_tokens))
    tok.padding_side = "left"
    return tok


def char_vocab(extra_chars: str = "", extra_tokens: Sequence[str] = ()) -> dict:
    """token → id of `build_char_tokenizer` (without building it)."""
    vocab = {PAD: 0, EOS: 1, BOS: 2}
    for t in TAGS:
        vocab[t] = len(vocab)
    for c in CHARS + extra_chars:
        vocab.setdefault(c, len(vocab))
    vocab["<unk>"] = len(vocab)
    for t in extra_tokens:
        vocab.setdefault(t, len(vocab))
    return vocab


def is_char_tokenizer(tok) -> bool:
    """Whether `tok` is the demo's character tokenizer (built here, or saved in a demo run's
    checkpoint): every id of `char_vocab` in place. The built-in arithmetic task is written in
    its characters, so it is the demo model's task and no other model's."""
    try:
        vocab = tok.get_vocab()
    except (AttributeError, NotImplementedError):
        return False
    return all(vocab.get(k) == v for k, v in char_vocab().items())


def tiny_config(arch: str = "qwen2", vocab_size: int = 128, hidden_size: int = 64, num_hidden_layers: int = 2,
                num_attention_heads: int = 2, num_key_value_heads: int = 1, head_dim: int = 32,
                intermediate_size: int = 128, tie_word_embeddings: bool = True,
                max_position_embeddings: int = 512, **overrides):
    """HF config of a tiny decoder. head_dim 32 by default: vLLM's CPU attention needs
    head_dim in {32, 64, 80, 96, 112, 128, …}."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}
    if arch not in classes:
        raise ValueError(f"arch={arch!r}: expected one of {sorted(classes)}")
    kwargs = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                  head_dim=head_dim, intermediate_size=intermediate_size,
                  tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2, rms_norm_eps=1e-6, rope_theta=10000.0)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def build_tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32,
                     tokenizer=None, **config_overrides) -> Tuple[torch.nn.Module, object]:
    """A randomly initialised tiny causal LM (fixed seed) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    tok = tokenizer if tokenizer is not None else build_char_tokenizer()
    config_overrides.setdefault("vocab_size", len(tok))
    cfg = tiny_config(arch, **config_overrides)
    devices = torch.random.fork_rng(devices=[])
    with devices:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok


def save_tiny(path: str, model, tokenizer) -> str:
    """save_pretrained of model (safetensors) and tokenizer into `path`; returns the path."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
