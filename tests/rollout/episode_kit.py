"""Shared pieces of the multi-turn episode tests: a byte-level BPE tokenizer with a Qwen-style chat
template (trained here, offline), its history-stripping variant (Qwen3 drops earlier <think>
blocks), a scripted engine that samples non-canonical token splits, and the trained-ids view of a
packed batch."""
import functools
import os
import sys
from typing import Callable, List

import torch

from fastgrpo.rollout.base import Completion, RolloutEngine

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

# Qwen2.5's shape, shortened: tool results go back as a user turn inside <tool_response> tags
APPEND_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3's history rule: an assistant turn before the last user message loses its <think> block
STRIP_TEMPLATE = (
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set c = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last and '</think>' in c %}"
    "{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + c + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")

_CORPUS = [
    "What is 12*34? Use the calculator.", "The answer is 408.", "<tool_call>", "</tool_call>",
    '{"name": "calculator", "arguments": {"expression": "12*34"}}', "<tool_response>", "</tool_response>",
    "<think>\nI should compute it.\n</think>\n\n", "hello world", "answer 12 34 408 99 7", "\n\n", "obs",
]


@functools.lru_cache(maxsize=None)
def _bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_CORPUS * 40, trainer)
    return tk.to_str()


def bpe_tokenizer(template: str = APPEND_TEMPLATE):
    """A byte-level BPE (decode → encode is not the identity on non-canonical splits) with `template`."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_bpe()), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    tok.chat_template = template
    return tok


def split_ids(tok, text: str) -> List[int]:
    """`text` as one token per character: a split the tokenizer itself would never produce."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]


class ScriptedEngine(RolloutEngine):
    """Samples what `script(context_text, turn)` says: (text, ends_with_eos); the text as one token
    per character (non-canonical), log-prob -0.01·(position + 1). Honors max_new_tokens (then
    finish_reason "length") and stops at a stop string, as the real engines do. `calls` records
    every (context ids, returned ids)."""

    def __init__(self, tokenizer, script: Callable, cap_override: int = 0):
        self.tokenizer = tokenizer
        self.script = script
        self.cap_override = cap_override  # > 0: the engine's own cap (vLLM's context) below the call's
        self.calls = []

    def _sample(self, prompt_ids, sampling, max_new_tokens, seeds):
        outs = []
        for ctx in prompt_ids:
            text = self.tokenizer.decode(ctx, skip_special_tokens=False)
            turn = text.count("<|im_start|>assistant")
            said, eos = self.script(text, turn)
            ids = split_ids(self.tokenizer, said) + ([self.tokenizer.eos_token_id] if eos else [])
            cap = min(max_new_tokens, self.cap_override or max_new_tokens)
            finish = "stop"
            if len(ids) > cap:
                ids, finish = ids[:cap], "length"
            outs.append(Completion(ids, [-0.01 * (k + 1) for k in range(len(ids))], finish,
                                   text=self.tokenizer.decode(ids, skip_special_tokens=True)))
            self.calls.append((list(ctx), list(ids)))
        return outs

    def update_weights(self, model_or_named):
        return None


def trained_ids(batches) -> dict:
    """{(prompt id, sample id): (ids trained with loss mask 1, every completion-space target)}."""
    out = {}
    for b in batches:
        if b is None:
            continue
        lo = b.loss_cu_seqlens.tolist()
        for s, key in enumerate(b.ids):
            t = b.targets[lo[s]:lo[s + 1]]
            m = b.loss_mask[lo[s]:lo[s + 1]] > 0
            out[tuple(key)] = (t[m].tolist(), t.tolist())
    return out


def sampled_of(ledger) -> List[int]:
    return [i for s in ledger.segments if s.kind == "sampled" for i in s.ids]


def tiny_model_for(tok, seed: int = 0):
    from fastgrpo.models.tiny import build_tiny_model

    model, _ = build_tiny_model(seed=seed, tokenizer=tok, vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                intermediate_size=64, num_attention_heads=2, head_dim=16)
    return model.eval()


def logits_perturbed(logits: torch.Tensor, rows: torch.Tensor, scale: float = 50.0) -> torch.Tensor:
    out = logits.detach().clone()
    out[rows] += scale * torch.randn_like(out[rows])
    return out
