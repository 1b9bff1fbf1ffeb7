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
                   "huggingface_hub", "py.warnings", "urllib3", "filelock", "accelerate", "trl",
                   "fastgrpo.reward_output")  # what user rewards print and warn (fastgrpo/rewards/worker.py), judge counts
_INFO_LOGGERS = ("vllm", "DeepSpeed", "deepspeed", "fastgrpo.reward_output")  # their INFO records are kept too


def quiet_console(out_dir: str, verbose: bool = False) -> str:
    """Route library logs to `<out_dir>/log.txt` (returned); with `verbose`, leave them alone."""
    path = os.path.join(out_dir, "log.txt")
    if verbose:
        return path
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
        lg.handlers = [handler]
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
        if self.stream is None:
            os.makedirs(os.path.dirname(self.baseFilename), exist_ok=True)
        super().emit(record)


class _FileOnlyLogger(logging.Logger):
    """A logger that refuses console handlers added after `quiet_console` (file handlers pass)."""

    def addHandler(self, hdlr):  # noqa: N802 - logging's name
        if isinstance(hdlr, logging.StreamHandler) and not isinstance(hdlr, logging.FileHandler):
            return
        super().addHandler(hdlr)
