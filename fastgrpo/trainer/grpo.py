"""The GRPO trainer: one `step()` that orders the phases of shared/DESIGN.md and computes nothing
itself.

Algorithm: GRPO (Shao et al. 2024, DeepSeekMath) as run in DeepSeek-R1 — G sampled completions
per prompt, verifiable rewards, group-normalised advantages, a clipped surrogate with K inner
updates per rollout batch (old log-probs stored as a float32 array per token, never a model
copy), a frozen reference model only when β > 0. DAPO's pieces are options: clip-higher,
dropping zero-σ groups, dynamic sampling (resample until the batch is full of informative groups).

Phases, each under an NVTX range and a `timing/<name>` timer of the same name: sample
(curriculum) → rollout → reward → advantages → pack → old_logp (only when K > 1 or β > 0: with
K = 1 the ratio is exactly 1 and the stored log-probs would equal the live ones; when the rollout
engine holds weights older than the policy — sync.every > 1, between syncs — the rollout's own
sampling log-probs are the old log-probs, packed with the batch) → update
(packed forward → loss → backward → clip → optimizer / scheduler) → sync → checkpoint.

The model and optimizer are reached only through `self.backend` (fastgrpo.trainer.backend's
`DistributedBackend`: `forward`, `accumulate`, `step`, `module`, `optimizer`, `lr_scheduler`,
`loss_scale`), so a DeepSpeed / DDP backend plugs in without touching the phases; rank and world
size come from the backend, which reads them from the launcher. With several ranks (verl's
layout) each rank rolls out its shard of the prompts, the curriculum is updated with every rank's
results (all-gathered, so the shared-seed samplers stay identical), and the rollout batch is
rebalanced (Karmarkar–Karp) before packing; under ZeRO-3 the weights are gathered for rollouts,
weight sync and the reference copy, and checkpoints hold every rank's optimizer partition. Non-finite loss or gradients skip
the optimizer step (never applied), are reported, and stop the run after
`max_nan_skips`. A reward function that raises is reported with the prompt id and scored as
configured (`rewards.on_error`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import copy
import random
import time
from types import SimpleNamespace
from typing import Dict, List

import numpy as np
import torch

from fastgrpo.advantages import compute_advantages, zero_std_groups
from fastgrpo.config import TrainConfig
from fastgrpo.curriculum import dynamic_sampling
from fastgrpo.models.packed import head_softcap
from fastgrpo.rewards.combine import score_groups
from fastgrpo.trainer.build import (build_curriculum, build_model, build_optimizer, build_rollout_engine, build_task,
                                    check_sync_sampling, model_context_len, sampling_config)
from fastgrpo.trainer.collectives import all_gather, all_reduce_metrics, shard
from fastgrpo.logs.metrics import MetricsLogger, Timers
from fastgrpo.rewards.process import attach_turn_advantages
from fastgrpo.trainer.step_metrics import rollout_metrics
from fastgrpo.trainer.resume import CheckpointMixin
from fastgrpo.trainer.update import TrainingStopped, UpdateMixin
from fastgrpo.runs.folder import stop_at_once, stop_deadline


def _signame(signum: int) -> str:
    import signal

    return signal.Signals(signum).name


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


class _NonFiniteRollout(Exception):
    """The sampler met non-finite logits: the step is skipped and counted (max_nan_skips)."""


class Trainer(UpdateMixin, CheckpointMixin):
    """GRPO on one task. Everything may be injected (tests, integrations); what is not is built
    from `cfg`."""

    def __init__(self, cfg: TrainConfig, model=None, tokenizer=None, task=None, engine=None, backend=None,
                 curriculum=None, log=print, rewards=None, episodes=None):
        from fastgrpo.trainer.backend import backend_from_config

        self.cfg = cfg
        self.log = log
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        seed_everything(cfg.seed)
        if model is None:
            model, tokenizer = build_model(cfg.model)
        self.tokenizer = tokenizer
        if task is None:  # as fastgrpo.pipeline.load_run builds it: prompts through the tokenizer's chat template
            task = build_task(cfg.data, tokenizer, context_len=model_context_len(model),
                              max_new_tokens=cfg.rollout.max_new_tokens)
        self.task = task
        self.steps_total = cfg.steps * cfg.algorithm.inner_steps
        if backend is None:
            optimizer, scheduler = build_optimizer(model, cfg.optimizer, self.steps_total)
            backend = backend_from_config(model, optimizer, scheduler, cfg.distributed, cfg.optimizer.max_grad_norm)
        self.backend = backend
        self.rank, self.world_size = backend.rank, backend.world_size
        if torch.device(getattr(backend, "device", "cpu")).type == "cpu":
            from fastgrpo.native.allocator import tune_host_allocator

            tune_host_allocator()  # reused activation buffers instead of fresh, faulting pages
        # the launcher (torchrun / deepspeed) decides the ranks; the config records them
        cfg.distributed.rank, cfg.distributed.world_size = self.rank, self.world_size
        cfg.distributed.local_rank = getattr(getattr(backend, "env", None), "local_rank", 0)
        # β = 0: no reference model at all (no memory, no forward)
        self.ref_model = None
        if cfg.algorithm.beta > 0:
            from fastgrpo.models.lora import is_lora

            # a LoRA policy's reference is its base: the module itself, scored with the adapter
            # disabled (update.py, `adapter_disabled`): no second model in memory
            self.ref_model = (self.backend.module if is_lora(self.backend.module)
                              else self._build_reference().eval().requires_grad_(False))
        self._prompt_ids: Dict[int, List[int]] = {}
        if engine is None:
            engine = build_rollout_engine(cfg.rollout, self.backend.module, tokenizer, prompt_len=self._max_prompt_len)
        self.engine = engine
        # multi-turn episodes (rollout.tools / rollout.env): the runner drives the engine turn by turn
        self.episodes = None
        if cfg.rollout.episodes:
            from fastgrpo.trainer.build import build_episode_runner, load_episode_parts

            parts = episodes if episodes is not None else \
                load_episode_parts(cfg.rollout, tokenizer, getattr(cfg, "config_dir", None))
            self.episodes = build_episode_runner(cfg.rollout, engine, tokenizer, parts)
            engine.episodes = self.episodes  # held-out evaluation runs episodes too (trainer.evaluation)
        self.curriculum = curriculum if curriculum is not None else build_curriculum(cfg, self.task)
        self.loss_cfg = cfg.algorithm.loss_config(cfg.rollout.temperature, cfg.rollout.max_new_tokens)
        # Gemma 2/3's final-logit cap runs inside the loss and scoring kernels (no capped [N, V] copy)
        self.loss_cfg = dataclasses.replace(self.loss_cfg, softcap=head_softcap(self.backend.module))
        self.sampling = sampling_config(cfg.rollout)
        self.timers = Timers(sync=torch.cuda.synchronize if torch.cuda.is_available() else None)
        self.metrics = MetricsLogger.for_run(cfg, enabled=self.rank == 0, log=log)  # + samples, W&B (logging.*)
        self.step_num = 0
        # the engine holds weights older than the policy (sync.every > 1, between syncs): its
        # rollouts are then off-policy and their own sampling log-probs are the old log-probs
        self._engine_stale = False
        self._save_pending = False  # a periodic checkpoint due while the engine was stale
        self.nan_skips = 0
        self.reward_errors = 0
        self._check_thinking_budget()
        self._weights_changed = False  # an optimizer step applied since the engine last got the weights
        self._grad_norms: List[float] = []  # recent accepted gradient norms (guard.grad_spike)
        self._spiked = False  # the spike guard refused the current update
        self._stop_signal = None  # SIGINT / SIGTERM received: stop after this step (request_stop)
        self.spike_skips = 0
        self.syncs_skipped = 0  # steps whose weight sync was skipped because no weight changed
        check_sync_sampling(cfg, shares_module=getattr(self.engine, "model", None) is self.backend.module)
        # rewards by name from the config (the task's own, the library's, a user's module:function);
        # a pipeline hands down the ones it built at load (RunParts)
        if rewards is None:
            from fastgrpo.rewards.registry import build_rewards

            rewards = build_rewards(cfg.rewards, self.task, cfg.rollout.max_new_tokens)
        self.reward_fns = rewards

    def _max_prompt_len(self) -> int:
        """Tokens of the task's longest prompt (train and held-out; the task's own count when it
        has one). Tokenizing them now also fills the trainer's prompt cache."""
        n = getattr(self.task, "max_prompt_len", None)
        if isinstance(n, int) and n > 0:
            return n
        probs = list(self.task.train) + list(getattr(self.task, "heldout", []) or [])
        self._tokenize(list(self.task.train))
        held = [p.prompt for p in getattr(self.task, "heldout", []) or []]
        lens = [len(t) for t in self._prompt_ids.values()]
        if held and self.tokenizer is not None:
            lens += [len(t) for t in self.tokenizer(held, add_special_tokens=False)["input_ids"]]
        return max(lens) if lens and probs else 0

    def _check_thinking_budget(self) -> None:
        r = self.cfg.rollout
        if not r.thinking_budget or self.tokenizer is None:
            return
        forced = len(self.tokenizer(self.sampling.interrupt, add_special_tokens=False)["input_ids"])
        if r.thinking_budget + forced + r.answer_budget > r.max_new_tokens:
            raise ValueError(f"config rollout.thinking_budget={r.thinking_budget} + the interrupt's {forced} tokens + "
                             f"rollout.answer_budget={r.answer_budget} exceed rollout.max_new_tokens={r.max_new_tokens}")

    def _build_reference(self):
        """A frozen copy of the policy's current weights. Under ZeRO-3 the parameters are
        0-element partitions carrying DeepSpeed's hooks, so a deepcopy would copy neither the
        values nor a usable module: rebuild from the config and load the gathered weights."""
        module = self.backend.module
        if not self._zero3():
            return copy.deepcopy(module)
        state = self.backend.full_state_dict()  # collective: every rank gathers
        ref = type(module)(module.config)
        ref.load_state_dict(state)
        dtype = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
        return ref.to(device=getattr(self.backend, "device", "cpu"), dtype=dtype)

    def _zero3(self) -> bool:
        return getattr(self.backend, "kind", None) == "deepspeed" and getattr(self.backend, "zero_stage", 0) == 3

    def _full_weights(self):
        """Context in which `backend.module` holds full weights: ZeRO-3 gathers its partitions
        (collective; what verl does before generating or syncing), other backends already do."""
        return self.backend.gathered_parameters() if self._zero3() else contextlib.nullcontext()

    # ------------------------------------------------------------------ phases
    def _rollout(self, problems):
        with self.timers.phase("rollout"):
            if self.cfg.rollout.sleep_between_steps:
                self.engine.wake_up()
            # the built-in engine runs the trainer's module itself, outside the engine's forward
            gen = getattr(self.backend, "generation_weights", None)
            # the engine samples from the same token ids the update trains on (one tokenizer call
            # for the prompts not seen yet, not one per prompt inside the engine)
            self._tokenize(problems)
            with gen() if gen is not None else contextlib.nullcontext():
                try:
                    ids = [self._prompt_ids[p.id] for p in problems]
                    if self.episodes is not None:  # multi-turn: turn by turn, tools out of process
                        groups = self.episodes.run(problems, ids, self.cfg.rollout.group_size, self.sampling)
                    else:
                        groups = self.engine.generate(ids, n=self.cfg.rollout.group_size, sampling=self.sampling)
                except ValueError as e:  # the sampler's finiteness check: the policy's logits are NaN / inf
                    if "not finite" not in str(e):
                        raise
                    raise _NonFiniteRollout(str(e)) from None
            if self.cfg.rollout.sleep_between_steps:
                self.engine.sleep()
        return groups

    def _score(self, problems, groups):
        """rewards[name] [B, G], their weighted total [B, G]; `dropped` group indices (on_error=drop).
        One `reward error` line per failing reward; a reward that failed on every completion for
        max_nan_skips steps in a row stops the run (fastgrpo.rewards.faults)."""
        r = self.cfg.rewards
        faults = getattr(self.reward_fns, "faults", None)
        with self.timers.phase("reward"):
            # rewards.timeout=0: user and model rewards run in this process with no limit, where one that
            # never returns would hold a stop requested meanwhile forever; a signal now stops at once
            self._rewards_here = not r.timeout
            try:
                per_fn, total, dropped, errors = score_groups(problems, groups, self.reward_fns, r.functions, r.weights,
                                                              error_score=r.error_score, on_error=r.on_error,
                                                              step=self.step_num + 1, faults=faults)
                # rewards.process: this batch's step scores → dense advantages
                process = getattr(self.reward_fns, "process", None)
                self._step_keep = (process.attach_dense(problems, groups, self.tokenizer) if process and process.dense
                                   else None)
                ro = self.cfg.rollout
                if ro.episodes and ro.turn_rewards == "dense":  # an environment's per-turn rewards → dense advantages
                    varies = attach_turn_advantages(groups, ro.turn_reward_weight)
                    self._step_keep = varies if self._step_keep is None else self._step_keep | varies
            finally:
                self._rewards_here = False
        errors = errors + (process.drain_errors() if process else [])
        for msg in errors:
            self.log(f"[fastgrpo] reward error: {msg}")
        self.reward_errors += len(errors)
        stop = faults.end_round(self.cfg.max_nan_skips) if faults is not None else None
        if self.world_size > 1 and all_reduce_metrics({"stop": float(bool(stop))}, op="max")["stop"] > 0:
            stop = stop or "a reward failed on every completion of another rank for max_nan_skips steps"  # all ranks stop
        if stop:
            raise TrainingStopped(f"stopped at step {self.step_num}: {stop}")
        return per_fn, total, dropped

    def _advantages(self, problems, per_fn, total, dropped):
        cfg = self.cfg
        with self.timers.phase("advantages"):
            B, G = total.shape
            flat = torch.as_tensor(total, dtype=torch.float32).reshape(-1)
            adv = compute_advantages(flat, G, estimator=cfg.algorithm.estimator, scale=cfg.algorithm.adv_std)
            adv = adv.reshape(B, G)
            zero_std = zero_std_groups(flat, G).numpy()
            keep = np.ones(B, dtype=bool)
            if cfg.algorithm.drop_zero_std:  # a group whose step scores vary keeps a (dense) signal
                step_keep = getattr(self, "_step_keep", None)
                keep &= ~zero_std if step_keep is None else ~zero_std | step_keep
            keep[list(dropped)] = False
            acc = per_fn.get("accuracy", (total > 0).astype(np.float64))
            # every rank scored only its shard: update with all ranks' results (in rank order)
            # so the shared-seed samplers draw the same prompts on every rank next step
            mine = ([p.id for p in problems for _ in range(G)], acc.reshape(-1).tolist())
            every = all_gather(mine)
            self.curriculum.update([i for r_ids, _ in every for i in r_ids], [a for _, r_acc in every for a in r_acc])
        return total, adv, keep, zero_std

    def _tokenize(self, problems) -> None:
        """Token ids of every prompt not seen yet into `_prompt_ids`, in one tokenizer call (a call
        per prompt cost ~0.1 ms each)."""
        new = list({p.id: p.prompt for p in problems if p.id not in self._prompt_ids}.items())
        if new:
            toks = self.tokenizer([text for _, text in new], add_special_tokens=False)["input_ids"]
            self._prompt_ids.update(zip((i for i, _ in new), toks))

    def sync_engine(self) -> None:
        """Bring an engine that is behind the policy (sync.every > 1) up to date now, e.g.
        before a held-out evaluation."""
        if self._engine_stale:
            with self._full_weights():
                self.engine.update_weights(self.backend.module)
            self._engine_stale = False

    def _sync(self):
        with self.timers.phase("sync"):
            if getattr(self.engine, "model", None) is self.backend.module:
                return  # the built-in engine samples from the trainer's own module: nothing to copy
            if not self._weights_changed and not self._engine_stale:
                self.syncs_skipped += 1  # no update applied (every group σ = 0, or skipped): the engine is current
                return
            if self.step_num % self.cfg.sync.every == 0:
                with self._full_weights():
                    self.engine.update_weights(self.backend.module)
                self._engine_stale = False
            else:
                self._engine_stale = True
            self._weights_changed = False

    # ------------------------------------------------------------------ the step
    def _round(self, n: int) -> SimpleNamespace:
        """One sampling round of `n` prompts (this rank's shard of them): sample → rollout →
        reward → advantages."""
        with self.timers.phase("sample"):
            problems = self.curriculum.sample(n)
            if self.world_size > 1:  # every rank draws the same list (same seed): each keeps its shard
                problems = shard(problems) or problems[:1]
        groups = self._rollout(problems)
        per_fn, total, dropped = self._score(problems, groups)
        total, adv, keep, zero_std = self._advantages(problems, per_fn, total, dropped)
        return SimpleNamespace(problems=problems, groups=groups, per_fn=per_fn, total=total, adv=adv, keep=keep,
                               zero_std=zero_std)

    def step(self) -> Dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.step_num += 1
        self._step_started = True  # a signal from now on stops after this step (request_stop's message)
        try:
            return self._step(cfg, t0)
        except _NonFiniteRollout as e:
            self.nan_skips += 1
            self.log(f"[fastgrpo] step {self.step_num}: non-finite logits while sampling, step skipped "
                     f"({self.nan_skips}/{cfg.max_nan_skips}): {e}")
            if self.nan_skips >= cfg.max_nan_skips:
                raise TrainingStopped(f"stopped at step {self.step_num}: {self.nan_skips} steps skipped for non-finite "
                                      f"logits, loss or gradients (max_nan_skips={cfg.max_nan_skips})") from None
            logs = {"train/skipped": 1.0, "train/nan_skips": float(self.nan_skips), "timing/step": time.perf_counter() - t0}
            self.metrics.log(self.step_num, logs)
            return logs

    def _step(self, cfg, t0) -> Dict[str, float]:
        # DAPO dynamic sampling: more rounds until the batch holds prompts_per_step informative
        # groups over all ranks, at most algorithm.dynamic_max_rounds; one round without it
        sampled = dynamic_sampling(
            self._round, cfg.rollout.prompts_per_step, kept_of=lambda r: int(r.keep.sum()),
            size_of=lambda r: len(r.problems),
            max_tries=cfg.algorithm.dynamic_max_rounds if cfg.algorithm.dynamic_sampling else 1,
            agree=lambda n: int(all_reduce_metrics({"n": float(n)}, op="sum")["n"]))
        rounds = sampled.rounds
        problems = [p for r in rounds for p in r.problems]
        groups = [g for r in rounds for g in r.groups]
        per_fn = {k: np.concatenate([r.per_fn[k] for r in rounds]) for k in rounds[0].per_fn}
        total, adv, keep, zero_std = (np.concatenate([getattr(r, f) for r in rounds])
                                      for f in ("total", "adv", "keep", "zero_std"))
        batches = self._pack(problems, groups, adv, keep)
        self._old_logp(batches)
        logs = self._update(batches)
        self._sync()
        if self.nan_skips >= cfg.max_nan_skips:
            raise TrainingStopped(f"stopped at step {self.step_num}: {self.nan_skips} updates skipped for non-finite "
                                  f"loss or gradients (max_nan_skips={cfg.max_nan_skips})")
        logs.update(rollout_metrics(per_fn, total, zero_std, groups))
        self.metrics.log_rollouts(self.step_num, problems, groups, per_fn, total, adv, zero_std)  # samples.jsonl
        logs["train/lr"] = self.backend.optimizer.param_groups[0]["lr"]
        logs["train/nan_skips"] = self.nan_skips
        logs["train/reward_errors"] = self.reward_errors
        logs["train/syncs_skipped"] = self.syncs_skipped
        # the sampler's and the rewards' own counters (judge asks); AsyncTrainer adds the orchestrator's
        for part in (self.curriculum, self.reward_fns, self.episodes, *getattr(self, "metric_sources", ())):
            logs.update(part.metrics() if hasattr(part, "metrics") else {})
        if cfg.algorithm.dynamic_sampling:
            logs.update(sampled.metrics())
        if cfg.checkpoint.every and self.step_num % cfg.checkpoint.every == 0:
            self._save_pending = True
        # a checkpoint waits for a step whose engine holds the policy's weights (sync.every > 1):
        # a resumed run then samples from the same weights as an uninterrupted one
        if self._save_pending and not self._engine_stale:
            self.save()
            self._save_pending = False
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

    # ------------------------------------------------------------------ run / state
    def train(self, progress=None, on_step=None) -> Dict[str, float]:
        """Run steps until cfg.steps; checkpoint at the end. Returns the last step's metrics."""
        from fastgrpo.runs.folder import TrainingInterrupted

        last: Dict[str, float] = {}
        while self.step_num < self.cfg.steps:
            try:
                last = self.step()
            except TrainingStopped as e:
                if self._stop_signal is None:
                    raise
                # the step a signal was waiting for stopped the run itself (a blow-up, a broken reward):
                # no checkpoint of it, and the line says so instead of leaving the announced one unexplained
                raise TrainingStopped(f"{e}; the {_signame(self._stop_signal)} received during step {self.step_num} "
                                      f"asked for a checkpoint after it, which a stopped step does not get "
                                      f"({self._last_checkpoint()})") from None
            if on_step is not None:
                on_step(self.step_num, last)
            if self._stop_signal is not None:  # SIGINT / SIGTERM during the step: checkpoint, then stop
                path = self.save()
                stop = TrainingInterrupted(self._stop_signal, self.step_num, path)
                stop_deadline(stop.exit_code, str(stop))  # the CLI's: what follows (closing) cannot hold the stop
                raise stop
        if self.cfg.checkpoint.at_end and self.step_num > 0:
            self.save()
        return last

    def stop_if_signalled(self) -> None:
        """After `train` returned: a signal that came during the final save still stops the run as
        it said (its checkpoint: the one at the end, else written now), before anything follows."""
        if self._stop_signal is None:
            return
        from fastgrpo.runs.checkpoint import latest_checkpoint
        from fastgrpo.runs.folder import TrainingInterrupted

        out = self.cfg.logging.out_dir
        path = latest_checkpoint(out) if self.cfg.checkpoint.at_end else self.save()  # as the loop does
        stop = TrainingInterrupted(self._stop_signal, self.step_num, path)
        stop_deadline(stop.exit_code, str(stop))
        raise stop

    def _last_checkpoint(self) -> str:
        """"the last checkpoint is …" of this run's folder (listed, not verified: cheap enough for a
        signal handler)."""
        from fastgrpo.runs.checkpoint import list_checkpoints

        found = list_checkpoints(self.cfg.logging.out_dir) if self.rank == 0 else []
        return (f"the last checkpoint is {found[-1]}" if found
                else "there is no checkpoint yet: a rerun starts the GRPO steps over")

    def request_stop(self, signum: int) -> None:
        """Finish the current step, checkpoint and raise TrainingInterrupted (a signal handler
        calls this: fastgrpo.runs.folder.graceful_signals). During rewards that run in this process
        (rewards.timeout=0) it stops at once instead: such a call may never return, so the step
        cannot be waited for (RunInterrupted, no checkpoint of the step)."""
        if getattr(self, "_rewards_here", False):
            self._rewards_here = False
            raise stop_at_once(signum, f"during the rewards of GRPO step {self.step_num}: with rewards.timeout=0 they "
                                       "run in the trainer process, where one that does not return cannot be waited "
                                       f"for, so the step gets no checkpoint ({self._last_checkpoint()}); run the same "
                                       "command to resume")
        self._stop_signal = signum
        # step() has already counted the step in progress; between steps the loop stops before the next one
        last = self.step_num if getattr(self, "_step_started", False) else self.step_num + 1
        self.log(f"[fastgrpo] {_signame(signum)}: stopping after step {last} "
                 "with a checkpoint (send it again to stop at once)")

    def close(self) -> None:
        self.metrics.close()
        if self.episodes is not None:
            self.episodes.close()
        if getattr(self.engine, "model", None) is not self.backend.module:
            self.engine.close()
