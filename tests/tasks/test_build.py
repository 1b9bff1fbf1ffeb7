"""build_task: kinds, splits (held-out file, dataset-dict split, seeded fraction), ids, the
prompt-length check, and one clear ValueError per bad input."""
import json

import pytest

from fastgrpo.config import DataConfig
from fastgrpo.tasks.arithmetic import ArithmeticTask
from fastgrpo.tasks.build import build_task


def _write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(p)


def _rows(n, start=0):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(start, start + n)]


def test_kinds(tmp_path):
    t = build_task(DataConfig())
    assert isinstance(t, ArithmeticTask) and len(t.heldout) == 200 and t.has_completions
    p = _write(tmp_path, _rows(2))
    assert build_task(DataConfig(path=p)).name == "math"
    j = build_task(DataConfig(task="jsonl", path=p))
    assert j.name == "jsonl" and sorted(j.reward_fns()) == ["accuracy", "format"]
    c = _write(tmp_path, [{"prompt": "write f", "tests": "assert f() == 1"}], "c.jsonl")
    assert build_task(DataConfig(path=c)).name == "code"
    assert build_task(DataConfig(path=p, columns={"tests": "answer"})).name == "code"


def test_eval_path_and_ids(tmp_path):
    t = build_task(DataConfig(path=_write(tmp_path, _rows(3)), eval_path=_write(tmp_path, _rows(2, 10), "e.jsonl")))
    assert [q.id for q in t.train] == [0, 1, 2] and [q.id for q in t.heldout] == [3, 4]
    assert t.heldout[0].key.endswith("e.jsonl:1") and t.heldout[0].answer == "11"


def test_integer_id_column_used_when_unique(tmp_path):
    rows = [dict(r, id=100 + i) for i, r in enumerate(_rows(3))]
    assert [q.id for q in build_task(DataConfig(path=_write(tmp_path, rows))).train] == [100, 101, 102]
    # strings, duplicates or a mix never crash: rows are numbered by position, the id kept as key
    for ids in (["a", "b", "c"], [1, 1, 2], [1, "x", 2.5]):
        rows = [dict(r, id=v) for r, v in zip(_rows(3), ids)]
        t = build_task(DataConfig(path=_write(tmp_path, rows)))
        assert [q.id for q in t.train] == [0, 1, 2] and [q.key for q in t.train] == [str(v) for v in ids]


def test_seeded_fraction_is_deterministic_and_disjoint(tmp_path):
    p = _write(tmp_path, _rows(50))
    a = build_task(DataConfig(path=p, eval_fraction=0.2, seed=3))
    b = build_task(DataConfig(path=p, eval_fraction=0.2, seed=3))
    c = build_task(DataConfig(path=p, eval_fraction=0.2, seed=4))
    ids = lambda ps: [q.id for q in ps]  # noqa: E731
    assert ids(a.heldout) == ids(b.heldout) and ids(a.train) == ids(b.train)
    assert len(a.heldout) == 10 and len(a.train) == 40 and not set(ids(a.heldout)) & set(ids(a.train))
    assert set(ids(a.heldout)) | set(ids(a.train)) == set(range(50)) and ids(c.heldout) != ids(a.heldout)
    assert ids(a.train) == sorted(ids(a.train))  # train keeps the file's order
    lim = build_task(DataConfig(path=p, limit=10, eval_fraction=0.3))
    assert len(lim.train) == 7 and len(lim.heldout) == 3 and max(ids(lim.train + lim.heldout)) < 10


def test_dataset_dict_eval_split_and_parquet(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(_rows(4)),
                               "test": datasets.Dataset.from_list(_rows(2, 20))})
    dd.save_to_disk(str(tmp_path / "dd"))
    t = build_task(DataConfig(path=str(tmp_path / "dd"), eval_split="test"))
    assert len(t.train) == 4 and [q.answer for q in t.heldout] == ["21", "22"]
    assert len({q.id for q in t.train + t.heldout}) == 6
    with pytest.raises(ValueError, match=r"data.eval_split='train': the same split as data.split"):
        build_task(DataConfig(path=str(tmp_path / "dd"), eval_split="train"))
    pq.write_table(pa.Table.from_pylist(_rows(3)), tmp_path / "t.parquet")
    t = build_task(DataConfig(path=str(tmp_path / "t.parquet"), eval_fraction=0.34))
    assert len(t.train) == 2 and len(t.heldout) == 1 and t.train[0].key.startswith(f"{tmp_path / 't.parquet'} row")


def test_prompt_length_cap(tmp_path, smol_tokenizer):
    rows = _rows(2) + [{"prompt": "word " * 300, "answer": "1"}]
    p = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=r"d\.jsonl:3: the prompt is \d+ tokens, over the cap of 100 "
                                         r"\(data.max_prompt_tokens=100\)"):
        build_task(DataConfig(path=p, max_prompt_tokens=100, chat_template="off"), smol_tokenizer)
    with pytest.raises(ValueError, match=r"d\.jsonl:3: .* over the cap of 232 \(the model's context 256 − "
                                         r"rollout.max_new_tokens 24\)"):
        build_task(DataConfig(path=p), smol_tokenizer, context_len=256, max_new_tokens=24)
    assert len(build_task(DataConfig(path=p), smol_tokenizer, context_len=8192, max_new_tokens=24).train) == 3
    with pytest.raises(ValueError, match=r"rollout.max_new_tokens=300: leaves no room"):
        build_task(DataConfig(path=p), smol_tokenizer, context_len=256, max_new_tokens=300)


@pytest.mark.parametrize("rows, cfg, match", [
    ([{"question": "q", "answer": "1"}], {}, r"d\.jsonl:1: no 'prompt' or 'messages' column .* data.columns.prompt"),
    ([{"prompt": "q", "answer": "1"}], {"columns": {"answer": "sol"}},
     r"d\.jsonl:1: no column 'sol' \(data.columns.answer=sol\)"),
    ([{"prompt": "q", "answer": "1"}, {"prompt": "r"}], {}, r"d\.jsonl:2: no column 'answer' \(the default answer"),
    ([{"prompt": "q", "answer": "1"}, {"prompt": "  ", "answer": "1"}], {}, r"d\.jsonl:2: column 'prompt' is empty"),
    ([{"prompt": "q", "answer": "1"}, {"prompt": "r", "answer": ""}], {}, r"d\.jsonl:2: column 'answer' is empty"),
    ([{"prompt": "q", "answer": "no marker here at all"}], {"answer_format": "gsm8k"},
     r"d\.jsonl:1: column 'answer': the reference .* answer_format=gsm8k"),
    ([{"prompt": "q", "answer": "1"}], {"columns": {"id": "uid"}}, r"d\.jsonl:1: no column 'uid' \(data.columns.id=uid\)"),
    ([{"prompt": "q", "answer": "1"}], {"few_shot": 1}, r"data.few_shot=1: only 0 train rows"),
    ([{"prompt": "q", "answer": "1"}], {"eval_fraction": 0.5}, r"data.eval_fraction=0.5: data.path has 1 row"),
    ([{"prompt": "q", "answer": "1"}], {"columns": {"prompt": "q", "messages": "m"}}, r"data.columns: map either"),
    ([{"prompt": "q", "tests": "assert (", "answer": "1"}], {}, r"d\.jsonl:1: column 'tests': the tests do not compile"),
])
def test_bad_input_one_line(tmp_path, rows, cfg, match):
    p = _write(tmp_path, rows)
    with pytest.raises(ValueError, match=match) as e:
        build_task(DataConfig(path=p, **cfg))
    assert "\n" not in str(e.value)


def test_missing_eval_path_and_template(tmp_path):
    p = _write(tmp_path, _rows(2))
    with pytest.raises(ValueError, match=r"data.eval_path='.*nope.jsonl': no such file"):
        build_task(DataConfig(path=p, eval_path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match=r"data.chat_template=on: no tokenizer"):
        build_task(DataConfig(path=p, chat_template="on"))


def test_tool_traces_as_completions(tmp_path):
    """A completion column (or a chat row's turns after its last user message) holding tool
    messages is a tool trace, kept as its messages (SFT renders them); a mapped completion column is
    not required of held-out rows; a trace that is not a run of model turns between environment
    messages is named."""
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(1+1)"}}</tool_call>'
    trace = [{"role": "assistant", "content": call}, {"role": "tool", "content": "2\n"},
             {"role": "assistant", "content": "The answer is 2."}]
    p = _write(tmp_path, [{"q": "1+1?", "answer": "2", "c": trace}])
    e = _write(tmp_path, [{"q": "2+2?", "answer": "4"}], "e.jsonl")
    t = build_task(DataConfig(path=p, eval_path=e, columns={"prompt": "q", "completion": "c"}))
    assert t.has_completions and t.heldout[0].completion is None
    assert t.train[0].completion == trace and t.train[0].prompt == "1+1?"   # kept as messages: SFT renders it
    chat = _write(tmp_path, [{"messages": [{"role": "user", "content": "1+1?"}] + trace, "answer": "2"}], "m.jsonl")
    assert build_task(DataConfig(path=chat)).train[0].completion == trace
    named = [trace[0], dict(trace[1], name="python"), trace[2]]   # the tool's name is kept, as the runner sends it
    t = build_task(DataConfig(path=_write(tmp_path, [{"prompt": "1+1?", "answer": "2", "completion": named}], "n.jsonl")))
    assert t.train[0].completion[1] == {"role": "tool", "content": "2\n", "name": "python"}
    bad = [([{"role": "tool", "content": "2"}, trace[2]], "starts and ends with an assistant turn"),
           ([trace[0], trace[2], trace[1], trace[2]], "two assistant turns in a row"),
           ([dict(trace[0], tool_calls=[{"name": "python"}]), trace[1], trace[2]], "structured tool_calls"),
           ([trace[0], {"role": "system", "content": "x"}, trace[2]], "role 'system'")]
    for value, msg in bad:
        with pytest.raises(ValueError, match=msg):
            build_task(DataConfig(path=_write(tmp_path, [{"prompt": "1+1?", "answer": "2", "completion": value}])))
