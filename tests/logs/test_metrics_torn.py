"""metrics.jsonl after a kill or a full disk: a torn last line must not swallow the resumed
run's first row (issue 14, item 8)."""
import json
import os

import pytest

from fastgrpo.logs.metrics import MetricsLogger, read_metrics

ROWS = [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]


@pytest.mark.parametrize("tail", ['{"step": 3, "loss": 0.1', '{"step": 3, "loss": 0.125}', "\x00" * 37, '{"st'])
def test_torn_last_line_keeps_the_next_row(tmp_path, tail):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + tail)
    m = MetricsLogger(str(tmp_path), tensorboard=False)
    m.log(3, {"loss": 0.75})
    m.log(4, {"loss": 0.5})
    m.close()
    rows = read_metrics(str(path))
    steps = [r["step"] for r in rows]
    # the resumed run's rows are both there; a complete but unterminated row is kept too
    assert steps[:2] == [1, 2] and steps[-2:] == [3, 4], steps
    assert rows[-2]["loss"] == 0.75
    assert len(rows) == (5 if tail.endswith("}") else 4)
    assert tail in path.read_text()  # the fragment itself is kept, on a line of its own


def test_clean_or_empty_file_is_left_as_is(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    MetricsLogger(str(tmp_path), tensorboard=False).close()
    assert path.read_text() == ""
    text = "".join(json.dumps(r) + "\n" for r in ROWS)
    path.write_text(text)
    MetricsLogger(str(tmp_path), tensorboard=False).close()
    assert path.read_text() == text
    assert not os.path.exists(tmp_path / "metrics.jsonl.tmp")


def test_tensorboard_meeting_a_full_disk_is_one_line_in_the_run_log(tmp_path, capfd, monkeypatch):
    """issue 34: a full disk left TensorBoard's writer thread printing "Exception in thread …" and a
    traceback, and the next row raised its error into the run. The writer now stops with one line
    in the run's log (logger fastgrpo.run → <run>/log.txt) and metrics.jsonl keeps every row."""
    import errno
    import logging

    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import record_writer

    real, calls = record_writer.RecordWriter.write, []

    def write(self, data):  # the file version event and the first scalar fit, then the disk is full
        calls.append(1)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    said = []
    monkeypatch.setattr(logging.getLogger("fastgrpo.run"), "warning", lambda msg, *a: said.append(msg % a))
    m = MetricsLogger(str(tmp_path), tensorboard=True)
    for step in range(1, 5):
        m.log(step, {"loss": 0.5, "reward/mean": 0.25})
    m.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert len(said) == 1 and "No space left on device" in said[0] and "TensorBoard" in said[0], said
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3, 4]
