"""SFT cold start (DeepSeek-R1 §2.3.1): supervised fine-tuning on reasoning traces in the target
format before RL, on the same packed layout and log-prob path as GRPO.

Sequences are packed with `fastgrpo.packing.bins.build_packed_batches` (prompt ‖ completion ‖ eos,
token-budget micro-batches), run through `fastgrpo.models.packed.packed_logits` (logits only at the
positions that predict completion tokens) and `fastgrpo.loss.token_logprobs` (the streaming
log-prob kernel); the loss is the token-mean cross-entropy −Σ logp / Σ tokens over the whole
batch, so prompt tokens never cost a logit. Departure from R1: the traces come from the task
(`task.sft_completion`, optionally with a fraction of corrupted answers, `sft.noise`) instead of
curated model outputs, and the run is short on purpose so that RL has headroom.
"""
from __future__ import annotations

import os
import random
from typing import Callable, Dict, Optional

import torch

from fastgrpo.config import TrainConfig
from fastgrpo.trainer.metrics import MetricsLogger


def sft_examples(task, problems, rng: random.Random, noise: float):
    """(prompt text, completion text) pairs: task.sft_completion(...) or a row's `completion`."""
    out = []
    for p in problems:
        if hasattr(task, "sft_completion"):
            out.append((p.prompt, task.sft_completion(p, rng, noise)))
        else:
            comp = getattr(p, "completion", None)
            if not comp:
                raise ValueError(f"problem id {p.id}: SFT needs a reference completion (jsonl field 'completion')")
            out.append((p.prompt, comp))
    return out


def run_sft(cfg: TrainConfig, model, tokenizer, task, out_dir: Optional[str] = None,
            on_step: Optional[Callable[[int, Dict[str, float]], None]] = None) -> Dict[str, float]:
    """Train `model` in place for cfg.sft.steps; saves it to `<out_dir>/sft/model` when out_dir
    is given. Returns the last step's metrics."""
    from fastgrpo.loss import token_logprobs
    from fastgrpo.models.packed import packed_logits
    from fastgrpo.packing.layout import build_packed_batches

    scfg = cfg.sft
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if model.get_input_embeddings().weight.device.type == "cpu":
        from fastgrpo.native.allocator import tune_host_allocator

        tune_host_allocator()  # reused activation buffers instead of fresh, faulting pages
    rng = random.Random(cfg.seed + 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=scfg.lr, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer: SFT needs an eos token (the model must learn to stop)")
    enc = {}

    def ids(text):
        if text not in enc:
            enc[text] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return enc[text]

    logger = MetricsLogger(os.path.join(out_dir, "sft"), tensorboard=False) if out_dir else None
    device = model.get_input_embeddings().weight.device
    model.train()
    last: Dict[str, float] = {}
    pool = task.train
    for step in range(1, scfg.steps + 1):
        probs = rng.sample(pool, scfg.batch_size) if len(pool) >= scfg.batch_size else rng.choices(pool, k=scfg.batch_size)
        pairs = sft_examples(task, probs, rng, scfg.noise)
        prompts = [ids(p) for p, _ in pairs]
        comps = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for _, c in pairs]
        batches = build_packed_batches(prompts, comps, [0.0] * len(prompts), cfg.packing.max_tokens,
                                       allow_oversize=True)
        n_tok = float(sum(b.num_completion_tokens for b in batches))
        total = 0.0
        for b in batches:
            b = b.to(device)
            logits = packed_logits(model, b)
            logp, _ = token_logprobs(logits, b.targets, 1.0, impl=cfg.algorithm.loss_impl)
            loss = -logp.sum() / n_tok
            loss.backward()
            total += float(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), scfg.max_grad_norm if scfg.max_grad_norm > 0 else float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = {"sft/loss": total, "sft/grad_norm": float(norm), "sft/tokens": n_tok}
        if logger is not None:
            logger.log(step, last)
        if on_step is not None:
            on_step(step, last)
    if logger is not None:
        logger.close()
    if out_dir:
        from fastgrpo.trainer.checkpoint import save_model_atomic

        # temp folder + complete-marker + rename: a crash mid-save never leaves a folder that counts
        save_model_atomic(model, tokenizer, os.path.join(out_dir, "sft", "model"))
    return last
