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


def test_numbers_and_the_bar_read_as_a_person_writes(tmp_path, monkeypatch):
    """issue 34: `eval/num_problems: 200.0000`, pass@k printed 8, 1, 4, `acc=0.00` on every
    step of a run that does not train on accuracy, a last line naming tb/ and plots/ that were
    never written."""
    from fastgrpo.logs.console import bar_postfix, eval_order, number, run_folder_line

    assert [number(v) for v in (200.0, 0.123456, 3, 12345.6, 0.5, True)] == ["200", "0.1235", "3", "12346", "0.5", "True"]
    ev = {"eval/pass@8": 1.0, "eval/num_problems": 200.0, "eval/pass@1": 0.5, "eval/accuracy": 0.5, "eval/pass@4": 0.9}
    assert eval_order(ev) == ["eval/accuracy", "eval/pass@1", "eval/pass@4", "eval/pass@8", "eval/num_problems"]
    assert "acc" not in bar_postfix({"reward/mean": 0.7, "perf/throughput": 10.0})  # process-only: no accuracy
    assert bar_postfix({"reward/mean": 0.7, "train/accuracy": 0.25})["acc"] == "0.25"
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "tb").mkdir()  # empty: nothing written there
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("tensorboard", "matplotlib") else real(n, *a))
    line = run_folder_line(str(tmp_path))
    assert line == (f"[fastgrpo] run folder: {tmp_path} (metrics.jsonl); no tb/ or plots/: tensorboard and matplotlib "
                    "are not installed (pip install tensorboard matplotlib)")
    assert run_folder_line(str(tmp_path), tensorboard=False, plots=False).endswith("(metrics.jsonl)")


def test_another_rank_logs_to_its_own_file(tmp_path, restore_loggers, capsys):
    """issue 34: rank 1 of `torchrun --nproc_per_node 2` printed DeepSpeed's and torch's lines
    on the console (a second copy of each); now they go to log-rank1.txt."""
    path = quiet_console(str(tmp_path), rank=1)
    logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU")
    for h in logging.getLogger("DeepSpeed").handlers:
        h.close()
    with open(path) as f:
        assert path.endswith("log-rank1.txt") and "Setting accelerator" in f.read()
    assert "Setting accelerator" not in capsys.readouterr().err
