"""Checkpoint and resume of `fastgrpo.trainer.grpo.Trainer` (a mixin: the methods read and set the
trainer's state). Files are written by `fastgrpo.runs.checkpoint` (atomic temp directory + rename,
checksums written last); with several ranks every rank adds its own RNG state, and under
DeepSpeed its optimizer partition, into rank 0's temp directory before the rename. Resume
verifies the checkpoint before restoring anything; `checkpoint.resume=auto` takes the newest
one that verifies and logs each newer one it skipped, naming the damaged file.
"""
from __future__ import annotations

import os
from typing import Optional

from fastgrpo.runs import checkpoint as ckpt
from fastgrpo.models import lora


class CheckpointMixin:
    def save(self) -> Optional[str]:
        """Checkpoint (collective). Rank 0 writes the model, curriculum and extras; with several
        ranks every rank also writes its RNG state (and, under DeepSpeed, its optimizer
        partition) into rank 0's temp directory before the atomic rename (fastgrpo/runs/checkpoint.py).
        Returns the path on rank 0."""
        from fastgrpo.trainer.collectives import all_gather
        from fastgrpo.trainer.backend import barrier

        with self.timers.phase("checkpoint"):
            ds = self.backend.kind == "deepspeed"
            multi = ds or self.world_size > 1
            # a LoRA run saves its live adapter (whole on every rank: ZeRO-3 is refused with LoRA at load),
            # not a gathered copy of every weight
            state = self.backend.full_state_dict() if ds and not lora.is_lora(self.backend.module) else None

            def shards(tmp: str) -> None:  # every rank, into rank 0's temp directory
                barrier()  # rank 0 has created the temp directory
                if ds:
                    self.backend.save_checkpoint(os.path.join(tmp, "engine"))
                ckpt.torch_save(ckpt.rng_state(), os.path.join(tmp, f"rng-rank{self.rank}.pt"))
                barrier()  # rank 0 fsyncs and renames only after every rank has written

            tmp = None
            if multi:
                tmp = all_gather(ckpt.begin_path(self.cfg.logging.out_dir, self.step_num) if self.rank == 0 else None)[0]
                if self.rank != 0:
                    shards(tmp)
                    barrier()  # rank 0 renamed: the checkpoint is complete for everyone
                    return None
            # under DeepSpeed the optimizer / scheduler state is in engine/ (partitioned), not state.pt
            from fastgrpo.trainer.lora_run import checkpoint_model  # a LoRA run saves its adapter folder

            path = ckpt.save_checkpoint(self.cfg.logging.out_dir, self.step_num, checkpoint_model(self.backend.module),
                                        None if ds else self.backend.optimizer,
                                        None if ds else self.backend.lr_scheduler, self.curriculum,
                                        tokenizer=self.tokenizer,
                                        extra={"nan_skips": self.nan_skips, "reward_errors": self.reward_errors,
                                               "engine_stale": bool(self._engine_stale),
                                               "rewards": self.reward_fns.state_dict()
                                               if hasattr(self.reward_fns, "state_dict") else {},
                                               **self._extra_state()},
                                        keep_last=self.cfg.checkpoint.keep_last, model_state=state,
                                        shards=shards if multi else None, tmp=tmp)
            if multi:
                barrier()
            return path

    def resume(self, path: str) -> int:
        ds = self.backend.kind == "deepspeed"
        if ds and not os.path.isdir(os.path.join(path, "engine")):
            raise ValueError(f"checkpoint {path!r}: no engine/ folder (it was not saved under distributed.backend="
                             "deepspeed); expected a checkpoint written by a DeepSpeed run")
        # under DeepSpeed the engine restores weights (ZeRO-3: partitions), optimizer and scheduler
        from fastgrpo.models.lora import is_lora
        from fastgrpo.trainer.lora_run import resume_adapter

        lora = is_lora(self.backend.module)  # its model/ is an adapter folder: loaded by resume_adapter
        state = ckpt.load_checkpoint(path, None if ds or lora else self.backend.module,
                                     None if ds else self.backend.optimizer,
                                     None if ds else self.backend.lr_scheduler, self.curriculum)
        if lora:
            resume_adapter(self.backend.module, path)
        if ds:
            self.backend.load_checkpoint(os.path.join(path, "engine"))
        mine = os.path.join(path, f"rng-rank{self.rank}.pt")
        if os.path.exists(mine):  # each rank's own RNG stream (state.pt holds rank 0's)
            ckpt.set_rng_state(ckpt.load_torch_file(mine))
        self.step_num = int(state["step"])
        if hasattr(self, "metrics"):  # the rows of the steps this run redoes leave metrics.jsonl
            self.metrics.drop_steps_after(self.step_num)
        self.nan_skips = int(state["extra"].get("nan_skips", 0))
        self.reward_errors = int(state["extra"].get("reward_errors", 0))
        if hasattr(self.reward_fns, "load_state_dict"):
            self.reward_fns.load_state_dict(state["extra"].get("rewards") or {})
        self._load_extra_state(state["extra"])
        if getattr(self.engine, "model", None) is not self.backend.module:
            with self._full_weights():
                self.engine.update_weights(self.backend.module)
            if state["extra"].get("engine_stale"):
                # saved explicitly (save() / the end of a run) between two syncs: the engine of the
                # saved run held older weights than it gets now. Periodic checkpoints wait for a
                # synced step, so resuming from one of those continues exactly.
                self.log(f"resume {path}: saved while the rollout engine was behind the policy "
                         f"(sync.every={self.cfg.sync.every}); the engine now gets the checkpoint's weights, "
                         "so rollouts until the next sync differ from the uninterrupted run's")
        self._engine_stale = False
        self._save_pending = False
        return self.step_num

    def _extra_state(self) -> dict:
        """More of the trainer's state for the checkpoint's extras (AsyncTrainer: the
        orchestrator's buffer and unreturned prompts)."""
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        """Restore what `_extra_state` saved (called by `resume` after the weights are loaded)."""

    def maybe_resume(self) -> Optional[str]:
        mode = self.cfg.checkpoint.resume
        if mode == "none":
            return None
        # auto: the newest checkpoint that verifies (each newer, damaged one is logged and skipped)
        path = ckpt.latest_checkpoint(self.cfg.logging.out_dir, log=self.log) if mode == "auto" else mode
        if path is None:
            return None
        self.resume(path)
        return path
