"""Built once, handed down (issue 32): `fastgrpo.pipeline` builds a run's tokenizer, task and
rewards once (RunParts) and every stage below takes them; the RM stage's task and rewards are
built once, at load. Counted on the demo run and on a run with the RM stage."""
import json

import pytest



def _count(monkeypatch, module, name, counts):
    import importlib

    mod = importlib.import_module(module)
    real = getattr(mod, name)

    def counted(*a, **kw):
        counts[name] = counts.get(name, 0) + 1
        return real(*a, **kw)

    monkeypatch.setattr(mod, name, counted)


@pytest.fixture
def counts(monkeypatch):
    c = {}
    _count(monkeypatch, "fastgrpo.rewards.registry", "build_rewards", c)
    _count(monkeypatch, "fastgrpo.trainer.build", "build_tokenizer", c)
    _count(monkeypatch, "fastgrpo.trainer.build", "build_task", c)
    _count(monkeypatch, "fastgrpo.models.tiny", "build_char_tokenizer", c)
    import fastgrpo.pipeline as pipeline
    import fastgrpo.trainer.build as b

    monkeypatch.setattr(pipeline, "build_task", b.build_task)  # pipeline imported the builder by name
    return c


def test_the_demo_run_builds_each_part_once(tmp_path, counts):
    from fastgrpo.pipeline import run_train

    from trainer_helpers import tiny_cfg

    run_train(tiny_cfg(tmp_path, "steps=1", "sft_first=true", "sft.steps=1"), log=lambda m: None)
    assert counts == {"build_rewards": 1, "build_tokenizer": 1, "build_task": 1, "build_char_tokenizer": 1}, counts


def test_the_rm_stage_builds_its_own_rewards_once(tmp_path, counts):
    from fastgrpo.pipeline import run_train

    from trainer_helpers import tiny_cfg

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    cfg = tiny_cfg(tmp_path / "run", "steps=1", "checkpoint.at_end=true", "rm_stage.steps=1",
                   f"rm_stage.prompts={prompts}", "rm_stage.functions=[accuracy, format]", "rm_stage.weights=[1.0, 0.1]")
    run_train(cfg, log=lambda m: None)
    # the run's rewards, the stage's rewards (at load), the stage's held-out accuracy: one each
    assert counts["build_rewards"] == 3, counts
    assert counts["build_tokenizer"] == 1 and counts["build_char_tokenizer"] == 1, counts


def test_a_real_model_without_data_is_refused_at_load(smollm2_path, tmp_path, capsys):
    """The embedded arithmetic task is the tiny demo model's: a real model with no data.path
    (the README's LoRA YAML as it was; `eval --set model.path=<merged folder>`) is refused at
    load with one line naming data.path, never trained or scored on it for 0.000 (issue 34)."""
    from fastgrpo import cli
    from fastgrpo.config import load_config
    from fastgrpo.pipeline import check_demo_task, load_run
    from fastgrpo.models.tiny import build_char_tokenizer

    with pytest.raises(ValueError, match=r"data.path is not set, so model.path=.* would be trained on the embedded demo"):
        load_run(load_config(None, [f"model.path={smollm2_path}", f"logging.out_dir={tmp_path / 'r'}"]))
    assert cli.main(["eval", "--set", f"model.path={smollm2_path}", "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert "would be scored on the embedded demo" in err and "give data.path=" in err and err.count("\n") == 1
    check_demo_task(load_config(None, ["data.task=arithmetic"]), object())  # asked for on purpose
    check_demo_task(load_config(None, []), build_char_tokenizer())  # the demo model's own task
