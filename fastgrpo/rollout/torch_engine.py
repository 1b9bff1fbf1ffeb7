"""Built-in rollout engine: batched sampling with a KV cache on the trainer's own HF model.

The default when vLLM is not installed, and the reference the vLLM engine is tested against.
Prompts are left-padded into one batch; each step feeds one token per row with explicit
position ids (so padding does not shift positions) and the HF cache. Sampling follows vLLM's
order — logits in float32 → / temperature → top-k → top-p → sample — and reports the log-prob of
the sampled token under that processed distribution (see base.py for what top-k / top-p do to
it). Each completion with a seed gets its own `torch.Generator`, so a completion does not depend
on the rest of the batch.

Departures from vLLM: no continuous batching (a batch runs until its longest row ends; finished
rows are fed padding), no prefix cache; stop strings are matched on the decoded completion.
Weight updates are direct (sync/direct.py): by default the engine *shares* the trainer's module,
so after an optimizer step there is nothing to copy.
"""
from __future__ import annotations

import copy
from typing import List, Optional

import torch

from fastgrpo.rollout.base import Completion, RolloutEngine, SamplingConfig


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float32 logits / temperature, with top-k / top-p truncated entries set to -inf (vLLM's
    `apply_top_k_top_p` semantics: top-p keeps the smallest set of mass >= p, at least 1)."""
    z = logits.float() / temperature
    vocab = z.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass strictly ahead of each token
        drop = before >= top_p
        drop[..., 0] = False
        z = z.scatter(-1, idx, sorted_z.masked_fill(drop, float("-inf")))
    return z


class TorchEngine(RolloutEngine):
    def __init__(self, model: torch.nn.Module, tokenizer=None, copy_model: bool = False,
                 max_batch_size: int = 64, pad_token_id: Optional[int] = None):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size!r}: expected an integer >= 1")
        self.model = copy.deepcopy(model) if copy_model else model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        gen = getattr(model, "generation_config", None)
        eos = tokenizer.eos_token_id if tokenizer is not None else getattr(gen, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
        if pad_token_id is None:
            pad_token_id = tokenizer.pad_token_id if tokenizer is not None else getattr(gen, "pad_token_id", None)
        self.pad_id = int(pad_token_id if pad_token_id is not None else 0)

    def update_weights(self, model_or_named):
        from fastgrpo.sync.direct import copy_weights

        named = model_or_named.named_parameters() if isinstance(model_or_named, torch.nn.Module) else model_or_named
        return copy_weights(self.model, named)

    def close(self) -> None:
        self.model = None

    def _sample(self, prompt_ids, sampling: SamplingConfig, max_new_tokens: int, seeds) -> List[Completion]:
        out: List[Completion] = []
        for i in range(0, len(prompt_ids), self.max_batch_size):
            out.extend(self._sample_batch(prompt_ids[i:i + self.max_batch_size], sampling, max_new_tokens,
                                          seeds[i:i + self.max_batch_size]))
        return out

    @torch.no_grad()
    def _sample_batch(self, prompt_ids, sampling: SamplingConfig, max_new_tokens: int, seeds) -> List[Completion]:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            return self._loop(model, device, prompt_ids, sampling, max_new_tokens, seeds)
        finally:
            model.train(was_training)

    def _loop(self, model, device, prompt_ids, sampling, max_new_tokens, seeds) -> List[Completion]:
        B = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((B, width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros((B, width), dtype=torch.long, device=device)
        for r, p in enumerate(prompt_ids):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long, device=device)
            mask[r, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        gens = [None if s is None else torch.Generator(device=device).manual_seed(s) for s in seeds]
        stop_ids = self.eos_ids | set(sampling.stop_token_ids)
        toks: List[List[int]] = [[] for _ in range(B)]
        lps: List[List[float]] = [[] for _ in range(B)]
        reason: List[Optional[str]] = [None] * B
        cache = None
        step_ids, step_pos = ids, pos
        for _ in range(max_new_tokens):
            res = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                        use_cache=True)
            cache = res.past_key_values
            logits = res.logits[:, -1, :].float()
            nxt, lp = self._pick(logits, sampling, gens)
            for r in range(B):
                if reason[r] is not None:
                    continue
                t = int(nxt[r])
                toks[r].append(t)
                lps[r].append(float(lp[r]))
                if t in stop_ids or (sampling.stop and any(s in self._decode(toks[r]) for s in sampling.stop)):
                    reason[r] = "stop"
            if all(x is not None for x in reason):
                break
            live = torch.tensor([x is None for x in reason], device=device)
            step_ids = torch.where(live, nxt, torch.full_like(nxt, self.pad_id)).unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, live.long().unsqueeze(1)], dim=1)
        return [Completion(toks[r], lps[r], reason[r] or "length", self._decode(toks[r])) for r in range(B)]

    @staticmethod
    def _pick(logits: torch.Tensor, sampling: SamplingConfig, gens):
        if sampling.temperature == 0:
            logp = logits.log_softmax(-1)
            nxt = logits.argmax(-1)
            return nxt, logp.gather(-1, nxt[:, None])[:, 0]
        z = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        logp = z.log_softmax(-1)
        probs = logp.exp()
        nxt = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
        for r, g in enumerate(gens):
            nxt[r] = torch.multinomial(probs[r], 1, generator=g)[0]
        return nxt, logp.gather(-1, nxt[:, None])[:, 0]
