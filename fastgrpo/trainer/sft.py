"""SFT cold start (DeepSeek-R1 §2.3.1): supervised fine-tuning on reasoning traces in the target
format before RL, on the same packed layout and log-prob path as GRPO.

Sequences are packed with `fastgrpo.packing.bins.build_packed_batches` (prompt ‖ completion ‖ eos,
token-budget micro-batches), run through `fastgrpo.models.packed.packed_logits` (logits only at the
positions that predict completion tokens) and `fastgrpo.loss.token_logprobs` (the streaming
log-prob kernel); the loss is the token-mean cross-entropy −Σ logp / Σ tokens over the whole
batch, so prompt tokens never cost a logit. Departure from R1: the traces come from the task
(`task.sft_completion`, optionally with a fraction of corrupted answers, `sft.noise`) instead of
curated model outputs, and the run is short on purpose so that RL has headroom.

Tool traces: a task may give a completion as segments [(text, trained), …] (the tool demo: a call,
the tool's answer, the final turn). Each segment is encoded on its own, as the episode runner
encodes an environment answer on its own, and the untrained ones (the tool's answer) get loss
mask 0: the token-mean runs over the trained tokens only, the mask GRPO's episodes use. A plain
string is one trained segment (the loss is then computed exactly as before masks existed).

Guards, GRPO's own (fastgrpo/trainer/update.py): a step whose loss or gradients are not finite
is skipped and counted (`max_nan_skips` of them stop the run); an update that grows the global
weight norm by more than `guard.max_weight_growth` (a learning rate far too high: `sft.lr=1e6`
does at step 1) stops the run with `TrainingStopped` before the model is saved, so no blown-up
`sft/model` is ever trained on. `load_saved_sft` verifies a saved `sft/model` against the sha256
of every file in its completion marker before it is used; a folder that does not verify (or, with
no marker, does not load) is moved aside — never deleted — and SFT runs again.
"""
from __future__ import annotations

import math
import os
import random
import time
from typing import Callable, Dict, Optional

import torch

from fastgrpo.config import TrainConfig
from fastgrpo.logs.metrics import MetricsLogger


def sft_examples(task, problems, rng: random.Random, noise: float, tokenizer=None):
    """(prompt text, completion) pairs: task.sft_completion(...) (a text, or segments [(text,
    trained), …]) or a row's `completion`; a tool trace (a message list) becomes segments with
    the ids an episode puts between its turns (fastgrpo.episodes.render.trace_segments, rendered
    with `tokenizer` and the task's `tool_schemas`)."""
    out = []
    renderer = None
    for p in problems:
        if hasattr(task, "sft_completion"):
            out.append((p.prompt, task.sft_completion(p, rng, noise)))
            continue
        comp = getattr(p, "completion", None)
        if not comp:
            raise ValueError(f"problem id {p.id}: SFT needs a reference completion (jsonl field 'completion')")
        if isinstance(comp, list) and comp and isinstance(comp[0], dict):  # a tool trace
            from fastgrpo.episodes.render import TurnRenderer, trace_segments

            if tokenizer is None:
                raise ValueError(f"problem id {p.id}: a tool trace needs the tokenizer to render its turns")
            renderer = renderer or TurnRenderer(tokenizer, tools=getattr(task, "tool_schemas", None))
            comp = trace_segments(renderer, comp)
        out.append((p.prompt, comp))
    return out


def _encode_completion(tokenizer, completion, eos: int):
    """(ids + [eos], None) of a text; (ids + [eos], per-token mask) of segments [(text, trained),
    …], each segment encoded on its own (eos trained with the last segment's flag)."""
    if isinstance(completion, str):
        return tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos], None
    ids: list = []
    mask: list = []
    for text, trained in completion:  # a segment's text, or its ids as they are (a tool trace's bridges)
        piece = list(text) if isinstance(text, list) else tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [1.0 if trained else 0.0] * len(piece)
    return ids + [eos], mask + [mask[-1] if mask else 1.0]


def _weight_norm(model) -> float:
    params = [p.detach() for p in model.parameters() if p.numel()]
    return float(torch.stack([n.float() for n in torch._foreach_norm(params)]).pow(2).sum().sqrt()) if params else 0.0


def _stopped(msg: str):
    from fastgrpo.trainer.grpo import TrainingStopped

    return TrainingStopped(msg)


def run_sft(cfg: TrainConfig, model, tokenizer, task, out_dir: Optional[str] = None,
            on_step: Optional[Callable[[int, Dict[str, float]], None]] = None,
            log: Optional[Callable[[str], None]] = None) -> Dict[str, float]:
    """Train `model` in place for cfg.sft.steps; saves it to `<out_dir>/sft/model` when out_dir
    is given. Returns the last step's metrics. Raises TrainingStopped (nothing saved) when the
    guards stop it (see the module docstring)."""
    log = log or print
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
    skips, limit = 0, cfg.guard.max_weight_growth
    try:
        for step in range(1, scfg.steps + 1):
            probs = rng.sample(pool, scfg.batch_size) if len(pool) >= scfg.batch_size else rng.choices(pool, k=scfg.batch_size)
            pairs = sft_examples(task, probs, rng, scfg.noise, tokenizer)
            prompts = [ids(p) for p, _ in pairs]
            comps, masks = zip(*[_encode_completion(tokenizer, c, eos) for _, c in pairs])
            masked = any(m is not None for m in masks)
            batches = build_packed_batches(prompts, comps, [0.0] * len(prompts), cfg.packing.max_tokens,
                                           completion_mask=([m or [1.0] * len(c) for c, m in zip(comps, masks)]
                                                            if masked else None), allow_oversize=True)
            n_tok = float(sum(b.num_loss_tokens if masked else b.num_completion_tokens for b in batches))
            total = 0.0
            for b in batches:
                b = b.to(device)
                logits = packed_logits(model, b)
                if not bool(torch.isfinite(logits).all()):  # the loss kernel refuses them: the step is skipped below
                    total = float("nan")
                    break
                logp, _ = token_logprobs(logits, b.targets, 1.0, impl=cfg.algorithm.loss_impl)
                loss = -(logp * b.loss_mask if masked else logp).sum() / n_tok
                loss.backward()
                total += float(loss.detach())
            clip = scfg.max_grad_norm if scfg.max_grad_norm > 0 else float("inf")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if not (math.isfinite(total) and math.isfinite(float(norm))):  # GRPO's non-finite guard
                opt.zero_grad(set_to_none=True)
                skips += 1
                log(f"[fastgrpo] SFT step {step}: non-finite loss or gradient, update skipped ({skips}/{cfg.max_nan_skips})")
                if skips >= cfg.max_nan_skips:
                    raise _stopped(f"SFT stopped at step {step}: {skips} updates skipped for non-finite loss or gradients "
                                   f"(max_nan_skips={cfg.max_nan_skips}); sft.lr={scfg.lr:g} may be too high; nothing "
                                   "was saved as sft/model")
                continue
            before = _weight_norm(model) if limit else 0.0
            opt.step()
            opt.zero_grad(set_to_none=True)
            if limit:  # GRPO's blow-up guard: the model is not saved, so nothing trains on it
                after = _weight_norm(model)
                if not math.isfinite(after) or (before > 0 and after > limit * before):
                    raise _stopped(f"SFT stopped at step {step}: the update grew the weight norm from {before:.4g} to "
                                   f"{after:.4g} (more than guard.max_weight_growth={limit}×): the model blew up — "
                                   f"sft.lr={scfg.lr:g} is likely too high; nothing was saved as sft/model")
            last = {"sft/loss": total, "sft/grad_norm": float(norm), "sft/tokens": n_tok}
            if logger is not None:
                logger.log(step, last)
            if on_step is not None:
                on_step(step, last)
    finally:
        if logger is not None:
            logger.close()
    if out_dir:
        from fastgrpo.runs.checkpoint import save_model_atomic

        from fastgrpo.trainer.lora_run import checkpoint_model

        # temp folder + complete-marker + rename: a crash mid-save never leaves a folder that counts.
        # A LoRA policy saves its adapter alone, as its checkpoints do (PEFT's folder, the base named
        # in its adapter_config.json): what SFT trained, a valid model.path, and what a resume loads
        save_model_atomic(checkpoint_model(model), tokenizer, os.path.join(out_dir, "sft", "model"),
                          what="the SFT model")
    return last


def sft_model_problem(sft_dir: str) -> Optional[str]:
    """Why the saved SFT model `sft_dir` must not be used (None when it may): a folder with a
    completion marker is verified against every file's size and sha256; one without (an older
    run's, or a save torn before its marker) is left to the load to judge."""
    from fastgrpo.runs import checkpoint as ckpt

    if not os.path.exists(os.path.join(sft_dir, ckpt.MODEL_MARKER)):
        return None
    return ckpt.verify_dir(sft_dir, ckpt.MODEL_MARKER, hashes=True)


def load_saved_sft(model, sft_dir: str, log: Callable[[str], None]) -> bool:
    """Load the saved SFT model `sft_dir` into `model` after verifying it (`sft_model_problem`).
    A folder that does not verify, or does not load, is moved aside (`model.broken-<time>`,
    never deleted) with one line saying why, and False is returned: SFT runs again."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models import lora

    why = sft_model_problem(sft_dir)
    if why is None:
        try:
            if lora.is_lora(model) and lora.is_adapter_dir(sft_dir):  # a LoRA run's SFT: its adapter, in place
                lora.load_adapter_state(model, sft_dir)
            else:
                model.load_state_dict(AutoModelForCausalLM.from_pretrained(sft_dir).state_dict())
            return True
        except Exception as e:  # noqa: BLE001 — any failure: the folder is not a usable model
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            state = "incomplete"
    else:
        state = "damaged"
    aside = f"{sft_dir}.broken-{time.strftime('%Y%m%d-%H%M%S')}"
    os.replace(sft_dir, aside)
    log(f"[fastgrpo] the saved SFT model {sft_dir} is {state} ({why}); moved to {aside}, running SFT again")
    return False
