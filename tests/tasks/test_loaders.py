"""load_rows on every source form, and its errors naming the file and line / row."""
import json

import pytest

from fastgrpo.tasks.loaders import load_rows

ROWS = [{"prompt": "1+1=", "answer": "2", "id": 7}, {"prompt": "2+3=", "answer": "5", "id": 8}]


def test_jsonl_skips_blank_lines_and_names_lines(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n")
    rows = load_rows(str(p))
    assert list(rows) == ROWS and rows.locations == [f"{p}:1", f"{p}:3"] and rows.positions == [0, 2]
    assert list(load_rows(str(p), limit=1)) == ROWS[:1]


@pytest.mark.parametrize("content, match", [
    (b'{"prompt": "a"}\n{"prompt": \n', r"a\.jsonl:2: not valid JSON"),
    (b'{"prompt": "a"}\n[1, 2]\n', r"a\.jsonl:2: expected a JSON object"),
    (b'{"prompt": "a"}\n{"prompt": "\xff"}\n', r"a\.jsonl:2: not UTF-8 \(byte 0xff"),
])
def test_jsonl_errors(tmp_path, content, match):
    p = tmp_path / "a.jsonl"
    p.write_bytes(content)
    with pytest.raises(ValueError, match=match):
        load_rows(str(p))


def test_json_array_object_and_lines(tmp_path):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(ROWS))
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"data": ROWS}))
    c = tmp_path / "c.json"
    c.write_text("\n".join(json.dumps(r) for r in ROWS))
    for p in (a, b, c):
        assert list(load_rows(str(p))) == ROWS
    bad = tmp_path / "bad.json"
    bad.write_text('[{"a": 1},\n  {"a": }]')
    with pytest.raises(ValueError, match=r"bad\.json:2: not valid JSON"):
        load_rows(str(bad))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), p)
    rows = load_rows(str(p))
    assert list(rows) == ROWS and rows.locations[1] == f"{p} row 1"
    assert list(load_rows(str(p), limit=1)) == ROWS[:1]


def test_csv_keeps_text_and_names_lines(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text('prompt,answer\n"multi\nline",007\nb,5\n')
    rows = load_rows(str(p))
    assert list(rows) == [{"prompt": "multi\nline", "answer": "007"}, {"prompt": "b", "answer": "5"}]
    assert rows.locations == [f"{p}:2", f"{p}:4"]
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\na,1\nb,2,3\n")
    with pytest.raises(ValueError, match=r"bad\.csv:3: 3 cells for 2 header columns"):
        load_rows(str(bad))


def test_save_to_disk_dataset_and_dict(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert list(load_rows(str(tmp_path / "ds"))) == ROWS
    dd = datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert list(load_rows(str(tmp_path / "dd"))) == ROWS
    rows = load_rows(str(tmp_path / "dd"), split="test")
    assert list(rows) == ROWS[:1] and rows.locations == [f"{tmp_path / 'dd'} [test] row 0"]
    with pytest.raises(ValueError, match=r"no split 'validation'; the dataset has splits \['train', 'test'\]"):
        load_rows(str(tmp_path / "dd"), split="validation")


def test_folder_of_data_files(tmp_path):
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    assert list(load_rows(str(tmp_path / "f"))) == ROWS


def test_missing_file_and_unknown_type(tmp_path):
    with pytest.raises(ValueError, match=r"data.path='nope/x.jsonl': no such file or folder"):
        load_rows("nope/x.jsonl")
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"unsupported file type \.txt"):
        load_rows(str(tmp_path / "a.txt"))


def test_hub_id_unreachable_fails_fast(monkeypatch):
    """No hub here: one clear line within seconds (datasets alone retries for ~25 s)."""
    import time

    from fastgrpo.tasks import loaders

    monkeypatch.setattr(loaders, "_hub_reachable", lambda: "huggingface.co:443 gaierror: no route")
    t = time.monotonic()
    with pytest.raises(ValueError, match=r"data.path='openai/gsm8k:main': not a local file or folder, and the "
                                         r"Hugging Face hub is unreachable .*HF_HUB_OFFLINE=1"):
        load_rows("openai/gsm8k:main")
    assert time.monotonic() - t < 5


def test_hub_probe_is_bounded():
    import time

    from fastgrpo.tasks.loaders import _PROBE_S, _hub_reachable

    t = time.monotonic()
    _hub_reachable()  # reachable or not, it returns within the probe's bound
    assert time.monotonic() - t < _PROBE_S + 1.5


def test_hub_offline_uses_cache_and_fails_in_one_line(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"data.eval_path='nobody/no-such-dataset': cannot load it from the "
                                         r"Hugging Face hub") as e:
        load_rows("nobody/no-such-dataset", field="data.eval_path")
    assert "\n" not in str(e.value)
