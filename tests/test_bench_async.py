"""benchmarks/bench_async.py: its arguments and run plan (fast), and a --smoke run on the tiny
model through both schedules (slow: Ray starts per run)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_async as B  # noqa: E402


def test_arguments_and_run_plan(tmp_path):
    a = B.parse_args(["--out", str(tmp_path), "--seeds", "0", "1", "--steps", "5"])
    specs = B.run_specs(a, {"train": "tr.jsonl", "test": "te.jsonl"})
    main = [s for s in specs if not s["label"].startswith("tail")]
    tail = [s for s in specs if s["label"].startswith("tail")]
    # seed by seed, every row of a seed adjacent in time (the machine's speed drifts)
    assert [(s["row"], s["seed"]) for s in main] == [(r, k) for k in (0, 1) for r in B.ROW_NAMES]
    assert {s["row"] for s in tail} == {"colocated", "async0", "async1"} and all(s["cap"] == 256 for s in tail)
    assert all(s["eval_every"] == 0 for s in tail) and all(s["eval_every"] == 10 for s in main)
    # the same prompts, G, cap and optimizer in every main row: the overrides differ only by schedule
    for s in main:
        o = s["overrides"]
        assert "data.path=tr.jsonl" in o and "rollout.max_new_tokens=64" in o and "steps=5" in o
        assert s["config"].endswith(os.path.join("smollm2_arithmetic", "config.yaml"))
    eta1 = next(s for s in main if s["row"] == "async1")["overrides"]
    assert {"rollout.mode=async", "rollout.workers=1", "rollout.worker_threads=1", "threads=1",
            "rollout.max_staleness=1"} <= set(eta1)
    with pytest.raises(ValueError, match="row 'async'"):
        B.parse_args(["--rows", "async"])
    with pytest.raises(SystemExit):
        B.parse_args(["--steps", "0"])
    tail_only = B.run_specs(B.parse_args(["--rows", "async0", "async1-keep", "--tail-only", "--out", str(tmp_path)]),
                            {"train": "tr.jsonl", "test": "te.jsonl"})
    assert [s["label"] for s in tail_only] == ["tail-async0", "tail-async1-keep"]
    assert "rollout.inflight=keep" in tail_only[1]["overrides"] and not any("inflight" in o for o in tail_only[0]["overrides"])
    with pytest.raises(ValueError, match="row 'async1-bogus'"):
        B.parse_args(["--rows", "async1-bogus"])
    smoke = B.parse_args(["--smoke", "--no-tail", "--rows", "colocated"])
    assert smoke.steps == 2 and smoke.seeds == [0] and [s["cap"] for s in B.run_specs(smoke, None)] == [8]


def test_summary_of_a_run():
    res = {"samples_per_step": 8, "rows": [
        {"step": 1, "wall": 5.0, "timing/rollout": 4.0, "timing/update": 1.0},
        {"step": 2, "wall": 7.0, "timing/rollout": 1.0, "timing/update": 1.0, "async/wait_rollout": 0.5,
         "completion/length_mean": 10.0},
        {"step": 3, "wall": 10.0, "timing/rollout": 2.0, "timing/update": 1.0, "async/wait_rollout": 1.5,
         "completion/length_mean": 20.0}]}
    s = B.summarize(res)
    assert s["samples_per_s"] == pytest.approx(16 / 5.0)  # the first (warm-up) step is left out
    assert s["tokens_per_s"] == pytest.approx(8 * (10 + 20) / 5.0)
    assert s["rollout"] == pytest.approx(1.5) and s["async/wait_rollout"] == pytest.approx(1.0)


@pytest.mark.slow
def test_smoke_run_writes_table_json_and_plot(tmp_path):
    pytest.importorskip("ray")
    out = B.main(["--smoke", "--rows", "colocated", "async1", "--no-tail", "--out", str(tmp_path)])
    assert all("error" not in r for r in out["results"]), [r.get("log_tail") for r in out["results"]]
    s = out["summaries"]
    assert s["colocated cap8"]["samples_per_s"] > 0 and s["async1 cap8"]["samples_per_s"] > 0
    assert s["async1 cap8"]["async/staleness_mean"] is not None
    data = json.load(open(tmp_path / "bench_async.json"))
    assert all(len(r["evals"]) == 2 for r in data)  # step 0 and the last step
    assert os.path.getsize(tmp_path / "bench_async.png") > 0 and os.path.exists(tmp_path / "async.csv")
