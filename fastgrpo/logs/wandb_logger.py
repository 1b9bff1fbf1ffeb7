"""Weights & Biases as an optional second record of a run (`logging.wandb`): the scalars of
metrics.jsonl under the same names and steps, the sample rows as `wandb.Table`s (`samples`,
`eval_samples`), the run config as the W&B run's config.

Follows TRL's W&B reporting (scalars per step, completions as a table). Where we depart: W&B is
never required — `mode: disabled` (the default) never imports it; wandb not installed, failing
to start (no network in `online` mode, a bad key) or failing to log ends in one warning line and
the run goes on, metrics.jsonl staying the record. `offline` needs no network: the run is written
under `<run>/wandb/offline-run-*` (WANDB_DIR when set) for a later `wandb sync`. A resumed run is
a new W&B run of the same name: W&B drops the values of steps it has already seen, and a resumed
fastgrpo run redoes the steps after its checkpoint. wandb's own console lines are silenced
(`silent`, `console="off"`): the console stays fastgrpo's.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Sequence


class WandbLogger:
    """One W&B run, or nothing (`self.run is None`) when disabled or when it could not start."""

    def __init__(self, cfg, out_dir: str, run_config: Optional[Dict] = None, log: Callable[[str], None] = print):
        self.run = None
        self.log = log
        self._wandb = None
        if cfg is None or cfg.mode == "disabled":
            return
        try:
            import wandb
        except Exception as e:  # ImportError, or a broken install failing at import
            self._warn(f"wandb is not importable ({type(e).__name__}: {e}); `pip install wandb` to report to W&B")
            return
        try:
            os.makedirs(out_dir, exist_ok=True)
            self.run = wandb.init(project=cfg.project, name=cfg.name or os.path.basename(os.path.abspath(out_dir)),
                                  mode=cfg.mode, dir=os.environ.get("WANDB_DIR") or out_dir, config=run_config or {},
                                  reinit="create_new", settings=wandb.Settings(silent=True, console="off"))
            self._wandb = wandb
        except Exception as e:  # wandb.errors.*, a timeout without network, a bad API key, ...
            self.run = None
            self._warn(f"W&B did not start in mode {cfg.mode} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")

    def _warn(self, why: str) -> None:
        self.log(f"[fastgrpo] warning: logging.wandb: {why}; the run goes on without W&B (metrics.jsonl stays the record)")

    def log_scalars(self, step: int, row: Dict[str, object]) -> None:
        """The numeric entries of a metrics row (lists such as the pass-rate histogram stay in
        metrics.jsonl)."""
        if self.run is None:
            return
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self._safe(lambda: self.run.log(scalars, step=int(step)))

    def log_table(self, key: str, step: int, columns: Sequence[str], data: Sequence[Sequence]) -> None:
        if self.run is None or not data:
            return
        self._safe(lambda: self.run.log({key: self._wandb.Table(columns=list(columns), data=[list(r) for r in data])},
                                        step=int(step)))

    def _safe(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # a W&B failure mid-run must not end a training run
            self._warn(f"logging failed ({type(e).__name__}: {e})")
            self.finish()

    def finish(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.finish()
            except Exception as e:
                self.log(f"[fastgrpo] warning: logging.wandb: finishing the W&B run failed ({type(e).__name__}: {e})")
