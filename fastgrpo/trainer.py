"""The GRPO trainer: one `step()` that orders the phases of shared/DESIGN.md and computes nothing
itself.

Algorithm: GRPO (Shao et al. 2024, DeepSeekMath) as run in DeepSeek-R1 — G sampled completions
per prompt, verifiable rewards, group-normalised advantages, a clipped surrogate with K inner
updates per rollout batch (old log-probs stored as a float32 array per token, never a model
copy), a frozen reference model only when β > 0. DAPO's pieces are options: clip-higher,
dropping zero-σ groups, dynamic sampling (resample until the batch is full of informative groups).

Phases, each under an NVTX range and a `timing/<name>` timer of the same name: sample
(curriculum) → rollout → reward → advantages → pack → old_logp (only when K > 1 or β > 0: with
K = 1 the ratio is exactly 1 and the stored log-probs would equal the live ones) → update
(packed forward → loss → backward → clip → optimizer / scheduler) → sync → checkpoint.

The model and optimizer are reached only through `self.backend` (fastgrpo.distributed's
`DistributedBackend`: `forward`, `accumulate`, `step`, `module`, `optimizer`, `lr_scheduler`,
`loss_scale`), so a DeepSpeed / DDP backend plugs in without touching the phases; rank and world
size come from the backend, which reads them from the launcher. Non-finite loss or gradients skip
the optimizer step (never applied), are reported, and stop the run after
`max_nan_skips`. A reward function that raises is reported with the prompt id and scored as
configured (`rewards.on_error`).
"""
from __future__ import annotations

import copy
import random
import time
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import torch

from . import checkpoint as ckpt
from .config import TrainConfig
from .metrics import MetricsLogger, Timers
from .packing import build_packed_batches
from .builders import build_curriculum, build_model, build_optimizer, build_rollout_engine, build_task, sampling_config


def _zero_loss(model) -> torch.Tensor:
    """A loss of exactly 0 touching every parameter: a skipped micro-batch still runs backward,
    so the gradient all-reduce of every rank stays aligned (a rank that skipped would hang)."""
    return sum(p.reshape(-1)[0] * 0.0 for p in model.parameters() if p.requires_grad)


class TrainingStopped(RuntimeError):
    """Raised when the run stops on purpose (too many non-finite steps)."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


class Trainer:
    """GRPO on one task. Everything may be injected (tests, integrations); what is not is built
    from `cfg`."""

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, task=None, engine=None, backend=None,
                 curriculum=None, log=print):
        from .distributed import backend_from_config

        self.cfg = cfg
        self.log = log
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        if model is None:
            model, tokenizer = build_model(cfg.model)
        self.tokenizer = tokenizer
        self.task = task if task is not None else build_task(cfg.data)
        self.steps_total = cfg.steps * cfg.algorithm.inner_steps
        if backend is None:
            optimizer, scheduler = build_optimizer(model, cfg.optimizer, self.steps_total)
            backend = backend_from_config(model, optimizer, scheduler, cfg.distributed, cfg.optimizer.max_grad_norm)
        self.backend = backend
        self.rank, self.world_size = backend.rank, backend.world_size
        # the launcher (torchrun / deepspeed) decides the ranks; the config records them
        cfg.distributed.rank, cfg.distributed.world_size = self.rank, self.world_size
        cfg.distributed.local_rank = getattr(getattr(backend, "env", None), "local_rank", 0)
        # β = 0: no reference model at all (no memory, no forward)
        self.ref_model = None
        if cfg.algorithm.beta > 0:
            self.ref_model = copy.deepcopy(self.backend.module).eval().requires_grad_(False)
        self.engine = engine if engine is not None else build_rollout_engine(cfg.rollout, self.backend.module, tokenizer)
        self.curriculum = curriculum if curriculum is not None else build_curriculum(cfg, self.task)
        self.loss_cfg = cfg.algorithm.loss_config(cfg.rollout.temperature, cfg.rollout.max_new_tokens)
        self.sampling = sampling_config(cfg.rollout)
        self.timers = Timers(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
        self.metrics = MetricsLogger(cfg.logging.out_dir, cfg.logging.tensorboard, enabled=self.rank == 0)
        self.step_num = 0
        self.nan_skips = 0
        self.reward_errors = 0
        self._prompt_ids: Dict[int, List[int]] = {}
        self.reward_fns = self.task.reward_fns()
        for name in cfg.rewards.functions:
            if name not in self.reward_fns:
                raise ValueError(f"config rewards.functions: {name!r} is not a reward of task "
                                 f"{getattr(self.task, 'name', type(self.task).__name__)} (it has {sorted(self.reward_fns)})")

    # ------------------------------------------------------------------ phases
    def _rollout(self, problems):
        with self.timers.phase("rollout"):
            if self.cfg.rollout.sleep_between_steps:
                self.engine.wake_up()
            groups = self.engine.generate([p.prompt for p in problems], n=self.cfg.rollout.group_size,
                                          sampling=self.sampling)
            if self.cfg.rollout.sleep_between_steps:
                self.engine.sleep()
        return groups

    def _score(self, problems, groups):
        """rewards[name] [B, G]; `dropped` group indices (on_error=drop)."""
        from .builders import score_groups

        with self.timers.phase("reward"):
            per_fn, dropped, errors = score_groups(problems, groups, self.reward_fns, self.cfg.rewards)
        for msg in errors:
            self.log(f"[fastgrpo] reward error: {msg}")
        self.reward_errors += len(errors)
        return per_fn, dropped

    def _advantages(self, problems, per_fn, dropped):
        from .advantages import compute_advantages

        cfg = self.cfg
        with self.timers.phase("advantages"):
            total = sum(w * per_fn[n] for n, w in zip(cfg.rewards.functions, cfg.rewards.weights))
            B, G = total.shape
            adv = compute_advantages(torch.as_tensor(total, dtype=torch.float32).reshape(-1), G,
                                     estimator=cfg.algorithm.estimator, scale=cfg.algorithm.adv_std)
            adv = adv.reshape(B, G)
            zero_std = total.std(axis=1) == 0
            keep = np.ones(B, dtype=bool)
            if cfg.algorithm.drop_zero_std:
                keep &= ~zero_std
            keep[list(dropped)] = False
            acc = per_fn.get("accuracy", (total > 0).astype(np.float64))
            self.curriculum.update([p.id for p in problems for _ in range(G)], acc.reshape(-1).tolist())
        return total, adv, keep, zero_std

    def _pack(self, problems, groups, adv, keep):
        from .distributed import plan_micro_batches

        with self.timers.phase("pack"):
            prompts, comps, advs, ids, cmask = [], [], [], [], []
            for i, (p, grp) in enumerate(zip(problems, groups)):
                pid = self._prompt_ids.get(p.id)
                if pid is None:
                    pid = self._prompt_ids[p.id] = self.tokenizer(p.prompt, add_special_tokens=False)["input_ids"]
                if not keep[i]:
                    continue
                for j, c in enumerate(grp):
                    prompts.append(pid)
                    comps.append(c.token_ids)
                    advs.append(float(adv[i, j]))
                    ids.append((p.id, j))
                    cmask.append([float(m) for m in c.sampled_mask])  # forced tokens carry no gradient
            lengths = [len(p) + len(c) for p, c in zip(prompts, comps)]
            budget = self.cfg.packing.max_tokens
            batches = []
            for plan in plan_micro_batches(lengths, budget):
                if not plan:
                    batches.append(None)  # this rank has fewer sequences: a zero-weighted dummy keeps collectives aligned
                    continue
                pick = lambda xs: [xs[k] for k in plan]  # noqa: E731
                batches.extend(build_packed_batches(pick(prompts), pick(comps), pick(advs), budget,
                                                    completion_mask=pick(cmask), ids=pick(ids),
                                                    allow_oversize=True))
        return batches

    @torch.no_grad()
    def _logprobs_of(self, model, batch):
        from .loss import token_logprobs
        from .models import packed_logits

        logits = packed_logits(model, batch)
        logp, _ = token_logprobs(logits, batch.targets.to(logits.device), self.loss_cfg.temperature,
                                 impl=self.cfg.algorithm.loss_impl)
        return logp.float().cpu()

    def _old_logp(self, batches):
        need_old = self.cfg.algorithm.inner_steps > 1
        with self.timers.phase("old_logp"):
            model = self.backend.module
            was = model.training
            model.eval()
            for b in batches:
                if b is None:
                    continue
                if need_old:
                    b.old_logp = self._logprobs_of(model, b)
                if self.ref_model is not None:
                    b.ref_logp = self._logprobs_of(self.ref_model, b)
            model.train(was)

    def _loss_fn(self, totals):
        from .loss import grpo_loss
        from .models import packed_forward

        cfg = self.cfg
        state = self._update_state

        def fn(model, b):
            dev = model.get_input_embeddings().weight.device
            b = b.to(dev)
            hidden = packed_forward(model, b)
            if not bool(torch.isfinite(hidden).all()):
                state.nonfinite = True
                return _zero_loss(model)
            logits = model.get_output_embeddings()(hidden)
            token_mean = self.loss_cfg.loss_agg == "token-mean"
            try:
                out = grpo_loss(logits, b.targets, b.advantages, mask=b.loss_mask, old_logp=b.old_logp,
                                ref_logp=b.ref_logp, cu_seqlens=b.loss_cu_seqlens, config=self.loss_cfg,
                                num_items=totals["tokens"] if token_mean else None, impl=cfg.algorithm.loss_impl,
                                return_entropy=True)
            except ValueError as e:  # the loss's own finiteness check (non-finite logits rows)
                if "NaN or Inf" not in str(e):
                    raise
                state.nonfinite = True
                return _zero_loss(model)
            # token-mean is normalised by the global token count already; per-sequence means are
            # per micro-batch, so weight each by its share of the global sequences
            scale = self.backend.loss_scale * (1.0 if token_mean else b.num_seqs / totals["seqs"])
            loss = out.loss * scale
            if not bool(torch.isfinite(loss)):
                state.nonfinite = True
                return loss * 0.0
            w = float(b.loss_mask.sum())
            state.tokens += w
            state.loss += float(out.loss.detach()) * scale / self.backend.loss_scale  # this rank's share of the batch loss
            for k, v in out.metrics.items():
                if k.endswith("_min") or k.endswith("_max"):  # extremes combine by min / max, not by mean
                    pick = min if k.endswith("_min") else max
                    state.extremes[k] = pick(state.extremes.get(k, float(v)), float(v))
                else:
                    state.sums[k] = state.sums.get(k, 0.0) + float(v) * w
            if out.entropy is not None:
                ent = (out.entropy.float() * b.loss_mask).sum()
                state.sums["entropy_mean"] = state.sums.get("entropy_mean", 0.0) + float(ent)
            return loss

        return fn

    def _grads_finite(self) -> bool:
        for p in self.backend.module.parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                return False
        return True

    def _update(self, batches):
        from .distributed import all_reduce_metrics

        local = {"tokens": sum(b.num_loss_tokens for b in batches if b is not None),
                 "seqs": sum(b.num_seqs for b in batches if b is not None)}
        totals = all_reduce_metrics(local, op="sum")
        totals["tokens"] = max(totals["tokens"], 1.0)
        totals["seqs"] = max(totals["seqs"], 1.0)
        logs = {}
        with self.timers.phase("update"):
            if not batches:  # every group had σ = 0 on every rank: nothing to learn from this batch
                return {"train/no_update": 1.0}
            self.backend.module.train()
            for _ in range(self.cfg.algorithm.inner_steps):
                self._update_state = SimpleNamespace(nonfinite=False, tokens=0.0, loss=0.0, sums={}, extremes={})
                self.backend.accumulate(batches, self._loss_fn(totals))
                st = self._update_state
                bad = all_reduce_metrics({"bad": float(st.nonfinite or not self._grads_finite())}, op="max")["bad"]
                if bad:
                    self.backend.optimizer.zero_grad(set_to_none=True)
                    self.nan_skips += 1
                    logs["train/skipped"] = 1.0
                    self.log(f"[fastgrpo] step {self.step_num}: non-finite loss or gradient, update skipped "
                             f"({self.nan_skips}/{self.cfg.max_nan_skips})")
                    break
                logs["train/grad_norm"] = self.backend.step()
                n = max(st.tokens, 1.0)
                logs["train/loss"] = st.loss
                logs.update({f"loss/{k}": v / n for k, v in st.sums.items()})
                logs.update({f"loss/{k}": v for k, v in st.extremes.items()})
        return logs

    def _sync(self):
        with self.timers.phase("sync"):
            if getattr(self.engine, "model", None) is self.backend.module:
                return  # the built-in engine samples from the trainer's own module: nothing to copy
            if self.step_num % self.cfg.sync.every == 0:
                self.engine.update_weights(self.backend.module)

    # ------------------------------------------------------------------ the step
    def step(self) -> Dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.step_num += 1
        rounds = 4 if cfg.algorithm.dynamic_sampling else 1
        problems, groups, per_fn, keep, adv, total, zero_std = [], [], None, None, None, None, None
        for _ in range(rounds):
            with self.timers.phase("sample"):
                want = cfg.rollout.prompts_per_step - (int(keep.sum()) if keep is not None else 0)
                new_p = self.curriculum.sample(max(want, 1))
                if self.world_size > 1:  # every rank draws the same list (same seed): each keeps its shard
                    from .distributed import shard

                    new_p = shard(new_p) or new_p[:1]
            new_g = self._rollout(new_p)
            new_fn, dropped = self._score(new_p, new_g)
            new_total, new_adv, new_keep, new_zero = self._advantages(new_p, new_fn, dropped)
            problems += new_p
            groups += new_g
            per_fn = new_fn if per_fn is None else {k: np.concatenate([per_fn[k], new_fn[k]]) for k in per_fn}
            cat = lambda a, b: b if a is None else np.concatenate([a, b])  # noqa: E731
            total, adv, keep, zero_std = cat(total, new_total), cat(adv, new_adv), cat(keep, new_keep), cat(zero_std, new_zero)
            if keep.sum() >= cfg.rollout.prompts_per_step:
                break
        batches = self._pack(problems, groups, adv, keep)
        self._old_logp(batches)
        logs = self._update(batches)
        self._sync()
        if self.nan_skips >= cfg.max_nan_skips:
            raise TrainingStopped(f"stopped at step {self.step_num}: {self.nan_skips} updates skipped for non-finite "
                                  f"loss or gradients (max_nan_skips={cfg.max_nan_skips})")
        logs.update(self._rollout_metrics(per_fn, total, zero_std, groups, problems))
        logs["train/lr"] = self.backend.optimizer.param_groups[0]["lr"]
        logs["train/nan_skips"] = self.nan_skips
        logs["train/reward_errors"] = self.reward_errors
        if hasattr(self.curriculum, "metrics"):
            logs.update(self.curriculum.metrics())
        if cfg.checkpoint.every and self.step_num % cfg.checkpoint.every == 0:
            self.save()
        logs.update(self.timers.pop())
        dt = time.perf_counter() - t0
        logs["timing/step"] = dt
        tokens = sum(len(self._prompt_ids[p.id]) * len(g) + sum(len(c.token_ids) for c in g)
                     for p, g in zip(problems, groups))
        # tokens/s of the whole step: prompt + completion tokens of every rollout sequence
        logs["perf/throughput"] = tokens / dt if dt > 0 else 0.0
        if self.step_num % cfg.logging.log_every == 0:
            self.metrics.log(self.step_num, logs)
        return logs

    def _rollout_metrics(self, per_fn, total, zero_std, groups, problems):
        from .distributed import all_reduce_metrics

        out = {"reward/mean": float(total.mean()), "reward/std": float(total.std())}
        for name, r in per_fn.items():
            out[f"reward/{name}/mean"] = float(r.mean())
            out[f"reward/{name}/std"] = float(r.std())
        lens = [len(c.token_ids) for g in groups for c in g]
        out["completion/length_mean"] = float(np.mean(lens))
        out["completion/length_max"] = float(np.max(lens))
        out["completion/truncation_rate"] = float(np.mean([c.finish_reason == "length" for g in groups for c in g]))
        out["train/zero_std_frac"] = float(zero_std.mean())
        if "accuracy" in per_fn:
            out["train/accuracy"] = float(per_fn["accuracy"].mean())
        out = all_reduce_metrics(out, op="mean", ops={"completion/length_max": "max"})
        if "accuracy" in per_fn:
            G = per_fn["accuracy"].shape[1]
            # pass-rate histogram: how many prompts had k of G completions correct, k = 0..G
            k = np.rint(per_fn["accuracy"].mean(axis=1) * G).astype(int)
            out["train/pass_rate_hist"] = np.bincount(np.clip(k, 0, G), minlength=G + 1).tolist()
        return out

    # ------------------------------------------------------------------ run / state
    def save(self) -> Optional[str]:
        with self.timers.phase("checkpoint"):
            model = self.backend.module
            state = self.backend.full_state_dict() if self.backend.kind == "deepspeed" else None
            if self.rank != 0:
                return None
            return ckpt.save_checkpoint(self.cfg.logging.out_dir, self.step_num, model, self.backend.optimizer,
                                        self.backend.lr_scheduler, self.curriculum, tokenizer=self.tokenizer,
                                        extra={"nan_skips": self.nan_skips, "reward_errors": self.reward_errors},
                                        keep_last=self.cfg.checkpoint.keep_last, model_state=state)

    def resume(self, path: str) -> int:
        state = ckpt.load_checkpoint(path, self.backend.module, self.backend.optimizer, self.backend.lr_scheduler,
                                     self.curriculum)
        self.step_num = int(state["step"])
        self.nan_skips = int(state["extra"].get("nan_skips", 0))
        self.reward_errors = int(state["extra"].get("reward_errors", 0))
        if getattr(self.engine, "model", None) is not self.backend.module:
            self.engine.update_weights(self.backend.module)
        return self.step_num

    def maybe_resume(self) -> Optional[str]:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return None
        path = ckpt.latest_checkpoint(self.cfg.logging.out_dir) if mode == "auto" else mode
        if path is None:
            return None
        self.resume(path)
        return path

    def train(self, progress=None, on_step=None) -> Dict[str, float]:
        """Run steps until cfg.steps; checkpoint at the end. Returns the last step's metrics."""
        last: Dict[str, float] = {}
        while self.step_num < self.cfg.steps:
            last = self.step()
            if on_step is not None:
                on_step(self.step_num, last)
        if self.cfg.checkpoint.at_end and self.step_num > 0:
            self.save()
        return last

    def close(self) -> None:
        self.metrics.close()
        if getattr(self.engine, "model", None) is not self.backend.module:
            self.engine.close()
