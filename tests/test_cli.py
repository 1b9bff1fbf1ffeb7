"""The command line on bad input: every expected failure is one line on stderr naming the
file / line / field, exit code 2, no traceback (`--debug` adds it) and no run folder; the
settings source is chosen by model.path (the demo only for the tiny model)."""
import argparse
import os

import pytest

from fastgrpo import cli


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("setup, argv, expect", [
    (lambda d: (d / "bad.yaml").write_text("steps: [1\n"), ["--config", "{d}/bad.yaml"], r"bad.yaml:2:1: invalid YAML"),
    (lambda d: None, ["--config", "{d}/missing.yaml"], r"missing.yaml: No such file or directory"),
    (lambda d: (d / "list.yaml").write_text("- 1\n"), ["--config", "{d}/list.yaml"], r"expected a YAML mapping"),
    (lambda d: None, ["--set", "rewards.functions=[nonexistent]"], r"rewards.functions\[0\]='nonexistent'"),
    (lambda d: None, ["--set", "optimizer.lr=fast"], r"optimizer.lr='fast': expected a finite number"),
    (lambda d: None, ["--set", "model.dtype=float16"], r"model.dtype='float16'"),
    (lambda d: (d / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "answer": "1"}\n'),
     ["--set", "data.path={d}/latin1.jsonl"], r"latin1.jsonl.*(UTF-8|utf-8)"),
    (lambda d: (d / "ids.jsonl").write_text('{"prompt": "1+1=", "answer": "2", "id": "abc"}\n'
                                            '{"prompt": "1+2", "answer": "x+"}\n'),
     ["--set", "data.path={d}/ids.jsonl"], r"ids.jsonl"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, argv, expect):
    import re

    setup(tmp_path)
    out = tmp_path / "run"
    argv = [a.format(d=tmp_path) for a in argv]
    rc, err = _run(capsys, "train", "--out", str(out), *argv)
    assert rc == 2, err
    lines = [x for x in err.splitlines() if x.startswith("fastgrpo:")]
    assert len(lines) == 1 and re.search(expect, lines[0]), err
    assert "Traceback" not in err
    assert not out.exists(), "a run refused at load must leave no run folder"


def test_debug_adds_the_traceback(tmp_path, capsys):
    rc, err = _run(capsys, "train", "--debug", "--out", str(tmp_path / "r"), "--config", str(tmp_path / "nope.yaml"))
    assert rc == 2 and "Traceback" in err and "nope.yaml" in err


def test_settings_source_follows_model_path(tmp_path):
    ns = lambda *o: argparse.Namespace(config=None, overrides=list(o))  # noqa: E731
    assert cli.uses_demo(ns())
    assert cli.uses_demo(ns("steps=3", "model.path=tiny"))
    assert not cli.uses_demo(ns("model.path=smollm2-135m"))
    assert not cli.uses_demo(ns("model={path: /models/x}"))
    own = tmp_path / "own.yaml"
    own.write_text("model: {path: /models/x}\n")
    assert not cli.uses_demo(argparse.Namespace(config=str(own), overrides=[]))
    part = tmp_path / "part.yaml"  # a README-style snippet: no model section, so the tiny model
    part.write_text("rewards: {functions: [accuracy], weights: [1.0]}\n")
    assert cli.uses_demo(argparse.Namespace(config=str(part), overrides=[]))


def _args(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_a_partial_config_keeps_the_demo_and_an_explicit_set_acts(tmp_path):
    """issue 26: a partial --config dropped the demo's settings (sft_first among them), so
    --set sft.steps was silently ignored; now the file changes the demo field by field, and the
    start-up line says what came from where."""
    part = tmp_path / "part.yaml"
    part.write_text("rewards: {functions: [accuracy], weights: [1.0]}\n")
    cfg, source, unused = cli.config_from_args(_args("train", "--config", str(part), "--set", "sft.steps=7",
                                                     "--out", str(tmp_path / "r")))
    assert cfg.sft_first and cfg.sft.steps == 7 and cfg.rewards.functions == ["accuracy"] and unused == []
    assert cfg.rollout.group_size == 8 and cfg.sft.lr == 3e-3  # the demo's, not the library defaults
    assert source.startswith("library defaults ← the embedded demo fastgrpo/demo/default.py (")
    assert f"config file {part} (2 fields: rewards.functions, rewards.weights)" in source
    assert source.endswith("--set (1 field: sft.steps)"), source


def test_a_set_the_run_would_not_use_is_said(tmp_path, capsys, monkeypatch):
    own = tmp_path / "own.yaml"
    own.write_text("model: {path: /models/none}\n")
    cfg, source, unused = cli.config_from_args(_args("train", "--config", str(own), "--set", "sft.steps=7"))
    assert not cfg.sft_first and source.startswith("library defaults ← config file")
    assert unused == ["--set sft.steps=7 has no effect in this run: sft_first=false; add --set sft_first=true to use it"]
    import fastgrpo.pipeline as pipeline

    monkeypatch.setattr(pipeline, "run_train", lambda cfg, log: None)
    assert cli.main(["train", "--out", str(tmp_path / "r"), "--set", "sft_first=false", "--set", "sft.lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "[fastgrpo] --set sft.lr=1e-3 has no effect in this run: sft_first=false" in out, out
    assert "--set (2 fields: sft.lr, sft_first)" in out, out


def test_eval_without_a_model_path_is_refused(tmp_path, capsys):
    out = tmp_path / "e"
    rc, err = _run(capsys, "eval", "--out", str(out))
    assert rc == 2 and "fastgrpo eval: model.path is not set" in err and "--untrained" in err, err
    assert not out.exists()


def test_eval_of_a_run_folder_starts_from_that_runs_settings(tmp_path):
    """`fastgrpo eval --set model.path=<run>` evaluates with the run's own config.yaml (its task,
    held-out split, rollout and rewards), as `fuse` does: from the library defaults it scored
    another task, with another completion cap, than the run's own evaluations."""
    from fastgrpo.config import dump_config
    from fastgrpo.demo.default import default_config

    run = tmp_path / "run"
    run.mkdir()
    dump_config(default_config(["rollout.max_new_tokens=24", "eval.max_problems=7"], out_dir=str(run)),
                str(run / "config.yaml"))
    for target in (run, run / "checkpoints" / "step-00000004"):
        cfg, source, _ = cli.config_from_args(_args("eval", "--set", f"model.path={target}", "--out", str(tmp_path / "e")))
        assert cfg.rollout.max_new_tokens == 24 and cfg.eval.max_problems == 7 and cfg.model.path == str(target)
        assert f"the RL run's config {run / 'config.yaml'}" in source and cfg.logging.out_dir == str(tmp_path / "e")


def test_eval_prints_what_it_scores_as_a_person_writes_and_leaves_no_temp_folder(tmp_path, capsys, monkeypatch):
    """issue 34: `eval/num_problems: 200.0000`, pass@k in the order computed, an eval that said
    nothing of its task, an empty `<run>/tmp/torchinductor` left by sft / eval / bench / fuse."""
    from fastgrpo.runs.folder import restore_compiler_cache, route_compiler_cache

    out = tmp_path / "e"
    assert cli.main(["eval", "--untrained", "--out", str(out), "--set", "data.num_heldout=3", "--set",
                     "eval.num_samples=4", "--set", "eval.temperature=1.0", "--set", "eval.pass_k=[2, 1]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "[fastgrpo] eval: 3 held-out problems of the built-in arithmetic task (data.task=arithmetic), 4 samples each" \
        in lines
    assert "eval/num_problems: 3" in lines
    keys = [ln.split(":")[0] for ln in lines if ln.startswith("eval/")]
    assert keys[:4] == ["eval/accuracy", "eval/pass@1", "eval/pass@2", "eval/pass@4"], keys
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    old = route_compiler_cache(str(out))  # torch makes the folder at import; nothing is compiled into it
    os.makedirs(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    restore_compiler_cache(old, str(out))
    assert not (out / "tmp").exists() and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
