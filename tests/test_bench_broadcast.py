"""benchmarks/bench_broadcast.py runs (a tiny model): every transport's sync arrives verified (the
script compares the receiver's checksums with the trainer's and fails on a wrong byte) and the
table has a row per case with the CPU each side spent."""
import csv

from benchmarks import bench_broadcast as B


def test_smoke_run_measures_every_transport(tmp_path):
    out = tmp_path / "broadcast.csv"
    assert B.main(["--smoke", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(open(out)))
    assert [r["case"] for r in rows] == list(B.CASES)
    for r in rows:
        assert float(r["median_ms"]) > 0 and float(r["trainer_cpu_s"]) >= 0 and float(r["worker_cpu_s"]) >= 0
