"""benchmarks/bench_tools.py runs (the tiny model, t = 0 / 0.05 s; k = 1 / 2, the continuous engine
turn-synchronous and continuous): every episode takes its 3 turns, the token check runs on all of
them (0 mismatches, else the script fails), and the table has a row per (row, t) with its
episodes/s and the hidden share beside it, the continuous row its ratio to the turn-synchronous
one with the cache kept (the like-for-like comparison)."""
import csv

from benchmarks import bench_tools as B


def test_smoke_run_checks_every_episode_and_writes_the_table(tmp_path, capsys):
    out, timeline = tmp_path / "tools.csv", tmp_path / "timeline.csv"
    assert B.main(["--smoke", "--csv", str(out), "--timeline", str(timeline)]) == 0
    printed = capsys.readouterr().out
    assert "token identity: 0 mismatched episodes of 32 " in printed and "turns {3: 32}" in printed
    rows = list(csv.DictReader(open(out)))
    cases = ["k=1 turn-sync", "k=2 in flight", "turn-sync, cache kept", "continuous"]
    assert [(r["case"], float(r["latency_s"])) for r in rows] == [(c, t) for t in (0.0, 0.05) for c in cases]
    assert all((r["speedup_vs_sync_cached"] != "") == (r["case"] == "continuous") for r in rows)
    for r in rows:
        assert float(r["episodes_per_s"]) > 0 and float(r["engine_s"]) > 0
    assert all(r["hidden"] != "" for r in rows if float(r["latency_s"]) > 0)
    phases = {(r["row"], r["phase"]) for r in csv.DictReader(open(timeline))}
    assert {("k=2 in flight", "decode"), ("k=2 in flight", "tool")} <= phases


def test_the_token_check_catches_a_trained_id_the_engine_did_not_sample():
    """mismatches() fails an episode whose mask-1 ids differ from what the engine returned."""
    from fastgrpo.episodes.ledger import Ledger
    from fastgrpo.rollout.base import Completion

    led = Ledger()
    led.append("prompt", [1, 2], 0)
    led.append("sampled", [3, 4], 1, logprobs=[-0.1, -0.2])
    led.append("environment", [5], 1)
    led.append("sampled", [6], 2, logprobs=[-0.3])
    led.end("done")
    c = Completion([3, 4, 5, 6], [-0.1, -0.2, 0.0, -0.3], "stop", sampled_mask=[1, 1, 0, 1])
    c.episode = led
    calls = [(0.0, 1.0, [((1, 2), (3, 4)), ((1, 2, 3, 4, 5), (6,))])]
    assert B.mismatches([[c]], calls) == {"mismatched_episodes": 0, "episodes": 1, "sampled_tokens": 3}
    bad = [(0.0, 1.0, [((1, 2), (3, 4)), ((1, 2, 3, 4, 5), (7,))])]  # the engine sampled 7, the ledger holds 6
    assert B.mismatches([[c]], bad)["mismatched_episodes"] == 1
    c.sampled_mask = [1, 1, 1, 1]  # an environment id trained
    assert B.mismatches([[c]], calls)["mismatched_episodes"] == 1


def test_episodes_that_queue_for_rows(tmp_path, capsys):
    """--max-batch 2 below N = 4: the engine decodes two rows at a time (k = 1 in chunks, the
    continuous loop hands a freed row to a waiting episode); every episode still checked."""
    out = tmp_path / "tools.csv"
    assert B.main(["--smoke", "--max-batch", "2", "--csv", str(out), "--timeline", str(tmp_path / "t.csv")]) == 0
    assert "token identity: 0 mismatched episodes of 32 " in capsys.readouterr().out
    rows = list(csv.DictReader(open(out)))
    assert rows and all(",B=2," in r["shape"] for r in rows)
