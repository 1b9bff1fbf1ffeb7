"""The quiet console (fastgrpo/logs/console.py): library logs go to <run>/log.txt, and a
second run (or stage) in the same process closes the first run's file."""
import logging

import pytest

from fastgrpo.logs.console import LIBRARY_LOGGERS, quiet_console


@pytest.fixture
def restore_loggers():
    saved = {n: (lg.handlers[:], lg.propagate, lg.__class__, lg.level)
             for n in LIBRARY_LOGGERS for lg in [logging.getLogger(n)]}
    yield
    for n, (handlers, propagate, cls, level) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers, lg.propagate, lg.__class__ = handlers, propagate, cls
        lg.setLevel(level)
    logging.captureWarnings(False)


def test_library_logs_go_to_the_run_file_and_a_second_run_closes_the_first(tmp_path, restore_loggers, capsys):
    first = quiet_console(str(tmp_path / "a"))
    logging.getLogger("transformers").warning("from the first run")
    (h1,) = logging.getLogger("transformers").handlers
    assert h1.stream is not None and not h1.stream.closed
    second = quiet_console(str(tmp_path / "b"))
    logging.getLogger("vllm").warning("from the second run")
    assert h1.stream is None  # FileHandler.close() drops its stream: no file left open
    assert "from the first run" in open(first).read() and "from the second run" in open(second).read()
    assert "from the" not in capsys.readouterr().err
    logging.getLogger("trl").addHandler(logging.StreamHandler())  # a console handler added later
    assert all(isinstance(h, logging.FileHandler) for h in logging.getLogger("trl").handlers)
