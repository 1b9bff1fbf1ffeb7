"""Phase timers, NVTX ranges and the run folder's metrics (metrics.jsonl, TensorBoard, PNG plots).

Each trainer phase runs under `phase("rollout")`, which opens an NVTX range named `rollout`
(visible in Nsight Systems when NVTX is on: `--nvtx` or FASTGRPO_NVTX=1) and records its wall
time as `timing/rollout`, so a profile and the metrics use the same names. NVTX comes from the
`nvtx` package (NVIDIA's Python bindings, a no-op without a profiler attached); when it is absent
torch.cuda.nvtx is used on GPU machines. Metrics rows go to `metrics.jsonl` (one JSON object per
line, flushed per row so that a killed run keeps every finished step), to TensorBoard through
torch.utils.tensorboard when tensorboard is importable, and to PNG plots drawn at the end with
matplotlib's Agg backend (no display needed). TensorBoard's writer writes from a thread of its own:
its first failure (a full disk) closes it with one line in the run's log (`<run>/log.txt`, logger
`fastgrpo.run`), not a thread's traceback on the console, and metrics.jsonl goes on (or fails with
the run's one line). A run killed mid-row or stopped by a full disk can
leave a torn last line; opening the file again ends that line first (`end_torn_line`), so the
resumed run's first row starts a line of its own instead of being glued onto the fragment (and
lost with it: `read_metrics` skips lines that do not parse). The same logger is the run's one
fan-out for what the model wrote (fastgrpo/logs/samples.py: `log_rollouts` → samples.jsonl, an
evaluation's completions → eval_samples.jsonl, both also as TensorBoard text tables) and for
Weights & Biases when `logging.wandb` asks for it (fastgrpo/logs/wandb_logger.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Dict, Iterable, List, Optional

from fastgrpo import env
from fastgrpo.logs.jsonl import end_torn_line, json_value, read_metrics, rewrite_lines  # noqa: F401  (re-exported)

_NVTX_FORCED: Optional[bool] = None


def set_nvtx(enabled: Optional[bool]) -> None:
    """Force NVTX on/off for this process (the CLI's --nvtx); None defers to FASTGRPO_NVTX."""
    global _NVTX_FORCED
    _NVTX_FORCED = enabled


def nvtx_on() -> bool:
    return env.nvtx_enabled() if _NVTX_FORCED is None else _NVTX_FORCED


@contextlib.contextmanager
def nvtx_range(name: str):
    """An NVTX range `name` when NVTX is on; nothing otherwise (zero cost in the hot loop)."""
    if not nvtx_on():
        yield
        return
    try:
        import nvtx  # NVIDIA's bindings: push/pop even without CUDA (no-op without a profiler)

        with nvtx.annotate(name, domain="fastgrpo"):
            yield
        return
    except ImportError:
        pass
    import torch

    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()
    else:
        yield


class Timers:
    """Accumulated wall seconds per phase within one step (`timing/<phase>`)."""

    def __init__(self, sync=None):
        self.sync = sync  # e.g. torch.cuda.synchronize so GPU work lands in its own phase
        self.times: Dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        with nvtx_range(name):
            if self.sync:
                self.sync()
            t0 = time.perf_counter()
            try:
                yield
            finally:
                if self.sync:
                    self.sync()
                key = f"timing/{name}"
                self.times[key] = self.times.get(key, 0.0) + time.perf_counter() - t0

    def pop(self) -> Dict[str, float]:
        out, self.times = self.times, {}
        return out


RUN_LOG = "fastgrpo.run"  # lines for the run's log only (<run>/log.txt: fastgrpo.logs.console)
_REPORTED: set = set()  # ids of writer failures already said (the thread's and the caller's copy are one object)


def _say_tb_failure(exc: BaseException, log_dir: str) -> None:
    if id(exc) in _REPORTED:
        return
    _REPORTED.add(id(exc))
    import logging

    logging.getLogger(RUN_LOG).warning("TensorBoard's writer stopped (%s: %s); %s holds the events written before, "
                                       "metrics.jsonl has every row", type(exc).__name__, exc, log_dir)


def _tb_writer_thread(thread) -> bool:
    try:
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:  # pragma: no cover - a TensorBoard without it has no such thread
        return False
    return isinstance(thread, _AsyncWriterThread)


def _quiet_writer_threads() -> None:
    """Once per process: an OSError that ends TensorBoard's writer thread (a full disk, a folder
    deleted mid-run) is one line in the run's log instead of Python's "Exception in thread"
    traceback on stderr; the writer keeps the exception and raises it at the next call, where
    `_TensorBoard` closes it. Every other thread's exception goes to the previous hook."""
    import threading

    previous = threading.excepthook
    if getattr(previous, "_fastgrpo_tb", False):
        return

    def hook(args):
        if args.exc_type is not None and issubclass(args.exc_type, OSError) and _tb_writer_thread(args.thread):
            _say_tb_failure(args.exc_value, "tb/")
            return
        previous(args)

    hook._fastgrpo_tb = True
    threading.excepthook = hook


class _TensorBoard:
    """torch's SummaryWriter, closed at its first failure with one line in the run's log: a full
    disk stops TensorBoard, not the run (metrics.jsonl meets the same disk and says so)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_threads()
        self.log_dir = log_dir
        self._w = SummaryWriter(log_dir=log_dir)

    def __getattr__(self, name):  # add_scalar, add_text, flush, close
        w = self.__dict__.get("_w")

        def call(*args, **kwargs):
            if w is None or self._w is None:
                return None
            try:
                return getattr(w, name)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 — whatever the writer hit, TensorBoard stops, the run goes on
                self._fail(e)
                return None

        return call

    def _fail(self, e: BaseException) -> None:
        _say_tb_failure(e, self.log_dir)
        w, self._w = self._w, None
        with contextlib.suppress(Exception):  # its thread has ended; the final flush meets the same disk
            w.close()


class MetricsLogger:
    """metrics.jsonl (+ TensorBoard events, + samples when `samples_every` > 0, + W&B when
    `wandb.mode` is not disabled) in `out_dir`. Only rank 0 writes."""

    def __init__(self, out_dir: str, tensorboard: bool = True, enabled: bool = True, samples_every: int = 0,
                 samples_max: int = 8, wandb=None, run_config: Optional[Dict] = None, log=print,
                 last_step: int = 0):
        self.out_dir = out_dir
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self._tb = None
        self._wandb = None
        self.samples_every, self.samples_max, self.log_line = samples_every, samples_max, log
        self.last_step = last_step  # the run's last step (cfg.steps): its samples are written too
        self._samples = self._eval_samples = None  # SamplesFile, opened at the first rollouts / evaluation
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        end_torn_line(self.path)
        self._f = open(self.path, "a")
        if tensorboard:
            try:
                import tensorboard  # noqa: F401  (torch's SummaryWriter needs it)

                self._tb = _TensorBoard(os.path.join(out_dir, "tb"))
            except ImportError:
                self._tb = None
        if wandb is not None and wandb.mode != "disabled":
            from fastgrpo.logs.wandb_logger import WandbLogger

            self._wandb = WandbLogger(wandb, out_dir, run_config, log=log)

    @classmethod
    def for_run(cls, cfg, enabled: bool = True, log=print) -> "MetricsLogger":
        """The trainer's logger: every `logging.*` setting of the TrainConfig `cfg`; W&B gets the
        whole config."""
        import dataclasses

        lg = cfg.logging
        return cls(lg.out_dir, lg.tensorboard, enabled=enabled, samples_every=lg.samples_every,
                   samples_max=lg.samples_max, wandb=lg.wandb, run_config=dataclasses.asdict(cfg), log=log,
                   last_step=cfg.steps)

    def log(self, step: int, metrics: Dict[str, object]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "time": time.time()}
        row.update({k: json_value(v) for k, v in metrics.items()})
        line = json.dumps(row) + "\n"
        from fastgrpo.runs.folder import saving

        with saving(f"the metrics of step {int(step)}", self.path):  # a full disk: one line naming the file
            self._f.write(line)
            self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log_scalars(step, {k: v for k, v in row.items() if k not in ("step", "time")})
        rows = getattr(metrics, "samples", None)  # an evaluation's completions (samples.EvalResult)
        if rows and self.samples_every:
            from fastgrpo.logs.samples import SamplesFile

            if self._eval_samples is None:
                self._eval_samples = SamplesFile(os.path.join(self.out_dir, "eval_samples.jsonl"), self.log_line)
            rows = [{"step": int(step), "tag": "eval", **r} for r in rows]
            self._eval_samples.write(rows)
            self._table("eval_samples", step, rows)

    def drop_steps_after(self, step: int) -> None:
        """A resumed run redoes the steps after its checkpoint's `step`: their rows (logged by the
        run that died) leave metrics.jsonl, so a plot has one point per step, as samples.jsonl
        does. Rewritten whole (temp file, fsync, rename); a torn fragment is kept (it is evidence
        of the kill, and `read_metrics` skips it)."""
        if not self.enabled or not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            lines = f.read().splitlines(keepends=True)

        def redone(line: bytes) -> bool:
            try:
                row = json.loads(line)
                return isinstance(row, dict) and int(row["step"]) > step
            except (ValueError, KeyError, TypeError):
                return False

        kept = [line for line in lines if not redone(line)]
        if len(kept) == len(lines):
            return
        self._f.close()
        rewrite_lines(self.path, kept)
        self._f = open(self.path, "a")

    def log_rollouts(self, step: int, problems, groups, per_fn, total, adv, zero_std) -> None:
        """Every `samples_every` steps, and at the run's first and last step (a run shorter than
        `samples_every` shows what the model wrote too), the step's selected rollouts
        (samples.select_samples) to samples.jsonl, TensorBoard and W&B. The first call of a run
        drops rows of steps >= `step` (the steps a resumed run redoes), whether or not this step
        writes."""
        if not self.enabled or not self.samples_every:
            return
        from fastgrpo.logs.samples import SamplesFile, select_samples

        if self._samples is None:
            self._samples = SamplesFile(os.path.join(self.out_dir, "samples.jsonl"), self.log_line)
            self._samples.open(step)
        if step % self.samples_every and step not in (1, self.last_step):
            return
        rows = select_samples(step, problems, groups, per_fn, total, adv, zero_std, self.samples_max)
        self._samples.write(rows)
        self._table("samples", step, rows)

    def _table(self, key: str, step: int, rows) -> None:
        """Rows as a TensorBoard text table (at most samples_max: Markdown of hundreds of rows
        does not render usefully) and a W&B table (all of them)."""
        from fastgrpo.logs.samples import flat_columns, markdown_table

        if self._tb is not None:
            self._tb.add_text(key, markdown_table(rows[: self.samples_max]), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log_table(key, step, *flat_columns(rows))

    def close(self) -> None:
        if not self.enabled:
            return
        self._f.flush()
        try:
            os.fsync(self._f.fileno())
        except OSError:  # a full disk: the rows written so far are what there is
            pass
        self._f.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for f in (self._samples, self._eval_samples):
            if f is not None:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()


# (file name, title, metric keys drawn on it)
PLOTS = (
    ("reward.png", "reward", ("reward/mean", "reward/accuracy/mean", "reward/format/mean")),
    ("accuracy.png", "accuracy", ("train/accuracy", "eval/accuracy")),
    ("length.png", "completion length", ("completion/length_mean", "completion/length_max")),
    # KL exists only when β > 0 (no reference model otherwise); the policy entropy is always drawn
    ("kl.png", "KL to reference (β > 0) and policy entropy", ("loss/kl_mean", "loss/entropy_mean")),
)


def make_plots(out_dir: str, plots: Iterable = PLOTS) -> List[str]:
    """PNG per plot in out_dir/plots from metrics.jsonl; returns the files written. A metric
    logged twice for one step (a resumed run re-doing steps) keeps its last value."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    try:
        import matplotlib
    except ImportError:  # plots are optional (the dev extra); metrics.jsonl and events remain
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    os.makedirs(os.path.join(out_dir, "plots"), exist_ok=True)
    written = []
    for fname, title, keys in plots:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = False
        for key in keys:
            pts = {}
            for r in rows:
                if r.get(key) is not None:
                    pts[r["step"]] = r[key]
            if pts:
                xs = sorted(pts)
                ax.plot(xs, [pts[x] for x in xs], marker="o" if len(xs) < 20 else None, label=key)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        if drawn:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        out = os.path.join(out_dir, "plots", fname)
        fig.savefig(out, dpi=80)
        plt.close(fig)
        written.append(out)
    return written
