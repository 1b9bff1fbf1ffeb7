"""Weights & Biases as an optional logger: an offline run (no network) holds the scalars under
metrics.jsonl's names, the samples table and the run config; wandb missing, failing to start or
failing mid-run is one warning line and the run goes on with metrics.jsonl as the record."""
import glob
import json
import os
import sys

import pytest
from trainer_helpers import NoisyTask

from fastgrpo.config import WandbConfig
from fastgrpo.trainer.grpo import Trainer
from fastgrpo.logs.metrics import MetricsLogger, read_metrics


@pytest.fixture
def offline_env(tmp_path, monkeypatch):
    """wandb offline and every wandb folder inside tmp_path."""
    for var, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_CONFIG_DIR", "wandb_config"),
                     ("WANDB_DATA_DIR", "wandb_data")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path / "wandb_dir"


def test_offline_run_holds_the_scalars_samples_and_config(cfg_factory, tmp_path, offline_env):
    pytest.importorskip("wandb")
    msgs = []
    cfg = cfg_factory("steps=2", "logging.samples_every=1", "logging.samples_max=3", "logging.wandb.mode=offline",
                      "logging.wandb.project=fastgrpo-test", "logging.wandb.name=tiny")
    t = Trainer(cfg, task=NoisyTask(), log=msgs.append)
    t.train()
    t.close()
    import wandb

    wandb.teardown()  # the records file is written by wandb's service process: flushed once it stops (seen: read early under load)
    assert not [m for m in msgs if "wandb" in m.lower()], msgs
    (run,) = glob.glob(str(offline_env / "wandb" / "offline-run-*"))
    (records,) = glob.glob(os.path.join(run, "run-*.wandb"))
    data = open(records, "rb").read()  # wandb's protobuf records: keys and names are stored as plain bytes
    logged = [k for k in read_metrics(str(tmp_path / "metrics.jsonl"))[-1] if k not in ("step", "time")]
    scalars = [k for k in logged if isinstance(read_metrics(str(tmp_path / "metrics.jsonl"))[-1][k], (int, float))]
    assert "reward/mean" in scalars and "timing/step" in scalars
    missing = [k for k in scalars if k.encode() not in data]
    assert not missing, f"metrics.jsonl keys not in the W&B run: {missing}"
    assert b"fastgrpo-test" in data and b"tiny" in data
    assert b"samples_every" in data and b"group_size" in data  # the run config
    tables = sorted(glob.glob(os.path.join(run, "files", "media", "table", "samples_*.table.json")))
    assert len(tables) == 2  # one per step
    table = json.load(open(tables[0]))
    assert len(table["data"]) == 3 and {"completion", "prompt", "reward", "reward/accuracy", "advantage"} <= set(table["columns"])


def test_wandb_not_installed_is_one_warning_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    msgs = []
    m = MetricsLogger(str(tmp_path), tensorboard=False, wandb=WandbConfig(mode="online"), log=msgs.append)
    m.log(1, {"reward/mean": 0.25})
    m.close()
    assert len(msgs) == 1 and "wandb" in msgs[0] and "goes on" in msgs[0] and "\n" not in msgs[0]
    assert read_metrics(str(tmp_path / "metrics.jsonl"))[0]["reward/mean"] == 0.25


def test_disabled_never_imports_wandb(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    msgs = []
    m = MetricsLogger(str(tmp_path), tensorboard=False, wandb=WandbConfig(), log=msgs.append)
    m.log(1, {"reward/mean": 0.25})
    m.close()
    assert msgs == []


def test_wandb_failing_to_start_or_to_log_is_one_warning_line(tmp_path, monkeypatch, offline_env):
    wandb = pytest.importorskip("wandb")

    def refuse(**kw):
        raise wandb.errors.CommError("network is unreachable\nsecond line of a long trace")

    monkeypatch.setattr(wandb, "init", refuse)
    msgs = []
    m = MetricsLogger(str(tmp_path / "a"), tensorboard=False, wandb=WandbConfig(mode="online"), log=msgs.append)
    m.log(1, {"reward/mean": 0.5})
    m.close()
    assert len(msgs) == 1 and "network is unreachable" in msgs[0] and "second line" not in msgs[0]
    assert read_metrics(str(tmp_path / "a" / "metrics.jsonl"))[0]["reward/mean"] == 0.5

    class _BrokenRun:
        def __init__(self):
            self.finished = 0

        def log(self, *a, **kw):
            raise OSError("disk full")

        def finish(self):
            self.finished += 1

    run = _BrokenRun()
    monkeypatch.setattr(wandb, "init", lambda **kw: run)
    msgs.clear()
    m = MetricsLogger(str(tmp_path / "b"), tensorboard=False, wandb=WandbConfig(mode="offline"), log=msgs.append)
    for step in (1, 2, 3):
        m.log(step, {"reward/mean": 0.5})
    m.close()
    assert len(msgs) == 1 and "disk full" in msgs[0] and run.finished == 1
    assert [r["step"] for r in read_metrics(str(tmp_path / "b" / "metrics.jsonl"))] == [1, 2, 3]
