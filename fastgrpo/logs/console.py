"""A quiet console: fastgrpo's progress bar and one line per phase event on the terminal; the
logs of the libraries underneath (vLLM, transformers, DeepSpeed, datasets, Python warnings) and
what user reward functions print or warn (`fastgrpo.reward_output`, relayed from their worker by
fastgrpo/rewards/worker.py) go to `<run folder>/log.txt` instead, unless `--verbose`.

`quiet_console(out_dir)` is called by the CLI before the libraries are imported (vLLM configures
its own stdout handler at import unless VLLM_CONFIGURE_LOGGING=0; its engine-core processes
inherit VLLM_LOGGING_LEVEL) and turns off the per-checkpoint "Writing model shards" and
dataset progress bars. Library users get the libraries' default behaviour: nothing here runs
unless called.
"""
from __future__ import annotations

import logging
import os
import warnings

LIBRARY_LOGGERS = ("vllm", "transformers", "DeepSpeed", "deepspeed", "datasets", "triton",
                   "ray",  # its driver-side lines: "Token authentication is enabled for this Ray cluster …"
                   "huggingface_hub", "py.warnings", "urllib3", "filelock", "accelerate", "trl",
                   "fastgrpo.reward_output",  # what user rewards print and warn (rewards/worker.py), judge counts
                   "fastgrpo.run")  # the run's log-only lines (TensorBoard's writer stopping: logs/metrics.py)
# the run folder whose log.txt this process's library logs go to (None: not quieted, a library
# user's process or --verbose): an async run's rollout workers quiet theirs into the same file
QUIETED = None
_INFO_LOGGERS = ("vllm", "DeepSpeed", "deepspeed", "fastgrpo.reward_output")  # their INFO records are kept too


def quiet_console(out_dir: str, verbose: bool = False, rank: int = 0) -> str:
    """Route library logs to `<out_dir>/log.txt` (returned; rank N > 0 of a multi-process launch:
    `log-rankN.txt`, so its DeepSpeed and torch warnings leave the console too, one copy of each
    line); with `verbose`, leave them alone."""
    global QUIETED
    path = os.path.join(out_dir, "log.txt" if not rank else f"log-rank{rank}.txt")
    if verbose:
        return path
    QUIETED = out_dir
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # in this process: our handler below
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its engine-core processes: errors only
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    handler = _LazyFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in LIBRARY_LOGGERS:
        lg = logging.getLogger(name)
        for old in lg.handlers:  # a previous run's (stage's) file handler in this process: closed
            if isinstance(old, _LazyFileHandler) and old is not handler:
                old.close()
        # a list that a library's `handlers.clear()` leaves alone: ray.init(configure_logging=False)
        # clears the "ray" logger's, and its token-authentication warning then reached the
        # console through logging's last-resort handler (issue 34)
        lg.handlers = _KeptHandlers([handler])
        lg.propagate = False
        # libraries that add their own console handler when imported later (DeepSpeed does, at
        # import) keep writing to the file only
        lg.__class__ = _FileOnlyLogger
        lg.setLevel(logging.INFO if name in _INFO_LOGGERS else logging.WARNING)
    logging.captureWarnings(True)
    warnings.simplefilter("default")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
        for lg in (hf_logging.get_logger(), logging.getLogger("transformers")):
            lg.handlers = [handler]
            lg.propagate = False
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:  # pragma: no cover - optional
        pass
    return path


class _LazyFileHandler(logging.FileHandler):
    """A FileHandler that creates its folder and file on the first record only (a command that
    fails at config load leaves no run folder behind)."""

    def __init__(self, path: str):
        super().__init__(path, encoding="utf-8", delay=True)

    def emit(self, record):
        try:
            if self.stream is None:
                os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
            super().emit(record)
        except OSError:  # the folder or file cannot be made (a full disk): as handleError below
            pass

    def handleError(self, record):  # noqa: N802 - logging's name
        """A record that cannot be written because of the disk (full, quota, read-only: the run says
        so in its own one line) is dropped quietly, not logging's "--- Logging error ---" traceback."""
        import sys

        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handleError(record)


class _KeptHandlers(list):
    """A quieted logger's handler list: `clear()` is a no-op (assigning a new list still works)."""

    def clear(self):
        pass


class _FileOnlyLogger(logging.Logger):
    """A logger that refuses console handlers added after `quiet_console` (file handlers pass)."""

    def addHandler(self, hdlr):  # noqa: N802 - logging's name
        if isinstance(hdlr, logging.StreamHandler) and not isinstance(hdlr, logging.FileHandler):
            return
        super().addHandler(hdlr)


def number(value) -> str:
    """A number as a person writes it: 200.0 → "200", 0.123456 → "0.1235", 1e-05 → "1e-05"
    (metrics are floats; a count printed as `200.0000` reads as a measurement)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float) and abs(value) >= 1000:
        return f"{value:.0f}"  # 12345.6 → "12346", not .4g's "1.235e+04"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def eval_order(metrics: dict) -> list:
    """An evaluation's keys as a reader scans them: accuracy, pass@k by k (1, 4, 8; not in the
    order they were computed), then the rest by name."""
    import re

    def rank(k):
        m = re.fullmatch(r"eval/pass@(\d+)", k)
        return (0, 0, k) if k == "eval/accuracy" else (1, int(m.group(1)), k) if m else (2, 0, k)

    return sorted(metrics, key=rank)


def bar_postfix(metrics: dict) -> dict:
    """The GRPO bar's fields for one step: the weighted reward, tokens/s, and the training
    accuracy only when `accuracy` is a training reward (a process-only or own-function run
    computes none: `acc=0.00` on every step read as a run that learns nothing)."""
    out = {"reward": f"{metrics.get('reward/mean', 0.0):.3f}"}
    if metrics.get("train/accuracy") is not None:
        out["acc"] = f"{metrics['train/accuracy']:.2f}"
    out["tok_s"] = f"{metrics.get('perf/throughput', 0.0):.0f}"
    return out


def restart_clock(bar) -> None:
    """Start a tqdm bar's clock again at its current count: its rate and ETA then leave out what
    came before. The GRPO bar calls it after the run's first step, whose one-time costs (a native
    build of 30-90 s, the compiler's first graphs) made the ETA read 7 h 15 m on a 2-minute run."""
    n = bar.n
    bar.reset()  # the count, the clock and the smoothed rate start again
    bar.n = bar.initial = bar.last_print_n = n  # rate = (n - initial) / elapsed: only steps after now
    bar.refresh()


_FOLDER_PARTS = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl", "tb", "plots", "checkpoints")


def missing_writers(tensorboard: bool = True, plots: bool = True) -> list:
    """The optional packages a run's settings ask for and this environment lacks (the `[gpu]`
    extra alone has neither), as (folder, package) pairs."""
    import importlib.util

    want = (("tb/", "tensorboard", tensorboard), ("plots/", "matplotlib", plots))
    return [(folder, pkg) for folder, pkg, on in want if on and importlib.util.find_spec(pkg) is None]


def run_folder_line(out_dir: str, tensorboard: bool = True, plots: bool = True) -> str:
    """The last line of a run: what its folder holds (only what was written) and, once, what
    was not for want of a package."""
    have = []
    for name in _FOLDER_PARTS:
        path = os.path.join(out_dir, name)
        if os.path.isdir(path) and os.listdir(path):
            have.append(name + "/")
        elif os.path.isfile(path) and os.path.getsize(path):
            have.append(name)
    line = f"[fastgrpo] run folder: {out_dir} ({', '.join(have) or 'empty'})"
    missing = missing_writers(tensorboard, plots)
    if missing:
        pkgs = " ".join(p for _, p in missing)
        line += (f"; no {' or '.join(f for f, _ in missing)}: {' and '.join(p for _, p in missing)} "
                 f"{'is' if len(missing) == 1 else 'are'} not installed (pip install {pkgs})")
    return line
