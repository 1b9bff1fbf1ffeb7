"""LoRA policies in the trainer (issue 24): only the adapter in the optimizer, the reference of
β > 0 is the base with the adapter disabled (no copy), checkpoints hold the adapter and resume
bit-exactly, `model.path` takes an adapter folder, `fastgrpo export --merge` writes a merged HF
folder, and the bad inputs fail at load naming the field."""
import json
import os

import pytest
import torch

from trainer_helpers import NoisyTask

from fastgrpo.models import lora
from fastgrpo.trainer.build import build_model
from fastgrpo.trainer.grpo import Trainer

LORA = ("model.lora.rank=4", "optimizer.lr=5e-3")


def _quiet(*_a, **_k):
    return None


def _adapter(trainer):
    return {k: v.detach().clone() for k, v in lora.adapter_named_tensors(trainer.backend.module).items()}


def _base(trainer):
    return {k: v.detach().clone() for k, v in trainer.backend.module.state_dict().items() if ".lora_" not in k}


def test_only_the_adapter_trains_and_the_base_stays(cfg_factory, tmp_path):
    t = Trainer(cfg_factory(*LORA, f"logging.out_dir={tmp_path / 'a'}"), task=NoisyTask(), log=_quiet)
    module = t.backend.module
    opt_params = [p for g in t.backend.optimizer.param_groups for p in g["params"]]
    adapter = list(lora.adapter_named_tensors(module).values())
    assert len(opt_params) == len(adapter) > 0
    assert {p.data_ptr() for p in opt_params} == {p.data_ptr() for p in adapter}
    base0, a0 = _base(t), _adapter(t)
    t.train()
    base1, a1 = _base(t), _adapter(t)
    t.close()
    assert all(torch.equal(base0[k], base1[k]) for k in base0), "a base weight moved"
    assert any(not torch.equal(a0[k], a1[k]) for k in a0), "the adapter never trained: test is vacuous"


def test_reference_is_the_base_with_the_adapter_disabled(cfg_factory, tmp_path):
    t = Trainer(cfg_factory(*LORA, "algorithm.beta=0.1", f"logging.out_dir={tmp_path / 'a'}"), task=NoisyTask(),
                log=_quiet)
    module = t.backend.module
    assert t.ref_model is module  # no copy of the model: the same module
    n_params = sum(p.numel() for p in module.parameters())
    with torch.no_grad():  # a trained-looking adapter: B ≠ 0, so the policy differs from its base
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    r = t._round(4)
    batches = t._pack(r.problems, r.groups, r.adv, r.keep)
    batches = [b for b in batches if b is not None]
    assert batches
    t._old_logp(batches)
    # the base alone: the same weights without the adapter, built independently
    base, _ = build_model(t.cfg.model.__class__(**{**t.cfg.model.__dict__, "lora": t.cfg.model.lora.__class__()}))
    base.load_state_dict({k.replace(".base_layer.", "."): v for k, v in module.state_dict().items()
                          if ".lora_" not in k})
    base.eval()
    for b in batches:
        want = t._logprobs_of(base, b)
        pol = t._logprobs_of(module, b)
        torch.testing.assert_close(b.ref_logp, want, rtol=0, atol=1e-5)
        assert (pol - want).abs().max() > 1e-3, "the adapter changes nothing: test is vacuous"
    assert sum(p.numel() for p in module.parameters()) == n_params
    assert all(p.requires_grad for n, p in module.named_parameters() if ".lora_" in n)  # re-enabled after
    t.close()


def test_lora_resume_continues_exactly(cfg_factory, tmp_path):
    extra = (*LORA, "steps=4", "algorithm.inner_steps=2", "optimizer.schedule=cosine", "algorithm.beta=0.05")
    a = Trainer(cfg_factory(*extra, f"logging.out_dir={tmp_path / 'a'}"), task=NoisyTask(), log=_quiet)
    a0 = _adapter(a)
    a.train()
    wa = _adapter(a)
    a.close()
    cfg_b = cfg_factory(*extra, f"logging.out_dir={tmp_path / 'b'}")
    b = Trainer(cfg_b, task=NoisyTask(), log=_quiet)
    b.step()
    b.step()
    path = b.save()
    b.close()
    mdir = os.path.join(path, "model")
    assert lora.is_adapter_dir(mdir) and not os.path.exists(os.path.join(mdir, "model.safetensors"))
    # the adapter and its AdamW state only: a small fraction of a full checkpoint's weights
    n_base = sum(v.numel() for v in _base(a).values())
    n_adapter = sum(v.numel() for v in wa.values())
    assert os.path.getsize(os.path.join(mdir, "adapter_model.safetensors")) < 4 * n_base * 0.5
    state = torch.load(os.path.join(path, "state.pt"), weights_only=False)
    moments = sum(v.numel() for s in state["optimizer"]["state"].values() for k, v in s.items() if k != "step")
    assert moments == 2 * n_adapter
    c = Trainer(cfg_b, task=NoisyTask(), log=_quiet)
    assert c.maybe_resume() == path and c.step_num == 2
    c.train()
    wc = _adapter(c)
    c.close()
    assert any(not torch.equal(a0[k], wa[k]) for k in wa), "training never changed the adapter: test is vacuous"
    for k in wa:
        assert torch.equal(wa[k], wc[k]), f"{k} differs between the uninterrupted and the resumed LoRA run"


def test_model_path_takes_an_adapter_folder_and_export_merges(cfg_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    from fastgrpo.cli import main
    from fastgrpo.config import dump_config

    cfg = cfg_factory(*LORA, f"logging.out_dir={tmp_path / 'run'}")
    os.makedirs(cfg.logging.out_dir)
    dump_config(cfg, os.path.join(cfg.logging.out_dir, "config.yaml"))
    t = Trainer(cfg, task=NoisyTask(), log=_quiet)
    with torch.no_grad():
        for name, p in t.backend.module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    t.save()
    ids = torch.tensor([[3, 10, 11, 12, 20, 5, 7]])
    with torch.no_grad():
        want = t.backend.module(input_ids=ids).logits
    t.close()
    # model.path = the run folder → its latest checkpoint's adapter on its base
    again, _ = build_model(cfg_factory(f"model.path={cfg.logging.out_dir}").model)
    assert lora.is_lora(again)
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=1e-5)
    out = tmp_path / "merged"
    assert main(["export", "--merge", cfg.logging.out_dir, str(out)]) == 0
    assert not os.path.exists(out / "adapter_config.json")
    merged = AutoModelForCausalLM.from_pretrained(str(out))  # plain transformers, no PEFT
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    # oracle rule: the merged float32 model within float32 rounding of the adapted one
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # issue 34: a non-empty folder or a file is refused (one line, exit 2), never replaced or moved
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own")
    (tmp_path / "a_file").write_text("mine too")
    assert main(["export", "--merge", cfg.logging.out_dir, str(mine)]) == 2
    assert main(["export", "--merge", cfg.logging.out_dir, str(tmp_path / "a_file")]) == 2
    assert main(["export", "--merge", cfg.logging.out_dir, str(mine), "--overwrite"]) == 2  # a file it did not write
    assert os.listdir(mine) == ["notes.txt"] and (tmp_path / "a_file").read_text() == "mine too"
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]  # nothing moved to a hidden folder
    assert main(["export", "--merge", cfg.logging.out_dir, str(out)]) == 2  # an earlier export: only asked for
    assert main(["export", "--merge", cfg.logging.out_dir, str(out), "--overwrite"]) == 0


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """issue 34: a full disk (here a quota) while the merged model is written: one line naming the
    folder and what was written, exit code 2, no partial folder."""
    import errno

    from transformers import PreTrainedModel

    from fastgrpo.cli import main
    from fastgrpo.config import load_config

    model, _ = build_model(load_config(None, ["model.lora.rank=2"]).model)
    adapter = lora.save_adapter(model, str(tmp_path / "adapter"))

    def full(self, path, **kwargs):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write("{")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    out = tmp_path / "merged"
    assert main(["export", "--merge", adapter, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fastgrpo: {out}: {os.strerror(errno.EDQUOT)} while saving the merged model — free space"), err
    assert sorted(os.listdir(tmp_path)) == ["adapter"], "no merged folder and no temp folder is left"


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from fastgrpo.cli import main

    def run(*sets):
        code = main(["train", *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "r"),
                     "--set", "steps=1", "--set", "rollout.engine=torch"])
        return code, capsys.readouterr().err.strip()

    code, err = run("model.lora.alpha=16")
    assert code == 2 and "model.lora.rank" in err and "\n" not in err
    code, err = run("model.lora.rank=100000")  # issue 34: refused at load, not after the whole SFT
    assert code == 2 and "model.lora.rank=100000: above the full rank of" in err and "expected 1 … 32" in err
    code, err = run("model.lora.rank=2", "model.lora.target_modules=[qproj]")
    assert code == 2 and "model.lora.target_modules[0]='qproj'" in err and "q_proj" in err and "down_proj" in err
    # an adapter folder whose base is missing
    bad = tmp_path / "adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                         "base_model_name_or_path": str(tmp_path / "gone")}))
    code, err = run(f"model.path={bad}")
    assert code == 2 and "model.path" in err and "gone" in err and "missing" in err
    assert not os.path.exists(tmp_path / "r" / "checkpoints")


def test_adapter_of_another_architecture_is_refused(tmp_path):
    from fastgrpo.config import load_config
    from fastgrpo.models.tiny import save_tiny
    from fastgrpo.trainer.lora_run import check_lora_run

    small, _ = build_model(load_config(None, ["model.lora.rank=2", "model.hidden_size=32"]).model)
    folder = str(tmp_path / "ad")
    lora.save_adapter(small, folder)
    cfg = json.loads(open(os.path.join(folder, "adapter_config.json")).read())
    assert cfg["base_model_name_or_path"].startswith("tiny:") and "hidden_size=32" in cfg["base_model_name_or_path"]
    assert check_lora_run(load_config(None, [f"model.path={folder}"])) == folder  # its own base: fits
    # the same adapter naming a base of other sizes (a HF folder of a hidden-64 model)
    wide, tok = build_model(load_config(None, ["model.hidden_size=64"]).model)
    base = save_tiny(str(tmp_path / "wide"), wide, tok)
    cfg["base_model_name_or_path"] = base
    open(os.path.join(folder, "adapter_config.json"), "w").write(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model.path=.*does not fit its base .*wide.*against a \[64, "):
        check_lora_run(load_config(None, [f"model.path={folder}"]))


def test_an_adapter_naming_another_base_of_the_same_shapes_is_refused_at_load(tmp_path, capsys):
    """issue 34: an adapter whose adapter_config.json names another base of the same shapes (two tiny
    models, seeds 0 and 1) trained silently. fastgrpo records a sample of the base's weights with
    the adapter (fastgrpo_base.json): another base, or the same folder with other weights, stops at
    load with one line naming both."""
    import shutil
    from pathlib import Path

    from fastgrpo.cli import main
    from fastgrpo.config import load_config
    from fastgrpo.models.tiny import save_tiny

    bases = {}
    for seed in (0, 1):
        m, tok = build_model(load_config(None, [f"model.seed={seed}"]).model)
        bases[seed] = save_tiny(str(tmp_path / f"base{seed}"), m, tok)
    trained, _ = build_model(load_config(None, [f"model.path={bases[0]}", "model.lora.rank=2"]).model)
    folder = lora.save_adapter(trained, str(tmp_path / "ad"))
    assert lora.is_lora(build_model(load_config(None, [f"model.path={folder}"]).model)[0])  # its own base: loads
    config = os.path.join(folder, "adapter_config.json")
    cfg = json.loads(Path(config).read_text())
    cfg["base_model_name_or_path"] = bases[1]
    Path(config).write_text(json.dumps(cfg))
    capsys.readouterr()  # the progress bars of the loads above
    rc = main(["train", "--out", str(tmp_path / "run"), *[x for s in (f"model.path={folder}", "steps=1",
               "rollout.engine=torch", "logging.progress=false", "data.num_heldout=0") for x in ("--set", s)]])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the adapter was trained on the base {os.path.abspath(bases[0])!r}" in err, err
    assert f"names the base {os.path.abspath(bases[1])!r}, another model of the same shapes" in err, err
    assert not os.path.exists(tmp_path / "run" / "checkpoints")
    # the base it names is the right folder, but its weights were replaced since
    cfg["base_model_name_or_path"] = bases[0]
    Path(config).write_text(json.dumps(cfg))
    shutil.rmtree(bases[0])
    shutil.copytree(bases[1], bases[0])
    with pytest.raises(ValueError, match=r"trained on the base .*base0', whose weights have changed since \(\d+ of "):
        build_model(load_config(None, [f"model.path={folder}"]).model)


def test_adapter_sync_with_an_engine_that_cannot_load_adapters_is_refused(monkeypatch):
    from fastgrpo.config import load_config
    from fastgrpo.rollout import vllm_support
    from fastgrpo.trainer.lora_run import check_lora_run

    monkeypatch.setattr(vllm_support, "vllm_lora_unsupported_reason", lambda model=None: "no LoRA in this vLLM")
    with pytest.raises(ValueError, match=r"model.lora.sync='adapter'.*no LoRA in this vLLM.*model.lora.sync=merged"):
        check_lora_run(load_config(None, ["model.lora.rank=2", "rollout.engine=vllm"]))
    # merged full weights need no LoRA in the engine; the built-in engine shares the module
    check_lora_run(load_config(None, ["model.lora.rank=2", "model.lora.sync=merged", "rollout.engine=vllm"]))
    check_lora_run(load_config(None, ["model.lora.rank=2", "rollout.engine=torch"]))


def test_sft_then_grpo_trains_the_adapter(cfg_factory, tmp_path):
    """SFT under LoRA trains the adapter alone too (the cold start and GRPO share the optimizer rule)."""
    from fastgrpo.trainer.sft import run_sft

    cfg = cfg_factory(*LORA, f"logging.out_dir={tmp_path / 's'}")
    model, tok = build_model(cfg.model)
    base0 = {k: v.clone() for k, v in model.state_dict().items() if ".lora_" not in k}
    a0 = {k: v.clone() for k, v in lora.adapter_named_tensors(model).items()}
    run_sft(cfg, model, tok, NoisyTask())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in base0.items())
    assert any(not torch.equal(v, lora.adapter_named_tensors(model)[k]) for k, v in a0.items())


def test_a_damaged_adapter_in_a_checkpoint_is_caught(cfg_factory, tmp_path):
    from fastgrpo.runs import checkpoint as ckpt

    t = Trainer(cfg_factory(*LORA, f"logging.out_dir={tmp_path / 'a'}"), task=NoisyTask(), log=_quiet)
    t.step()
    first = t.save()
    t.step()
    second = t.save()
    t.close()
    f = os.path.join(second, "model", "adapter_model.safetensors")
    data = bytearray(open(f, "rb").read())
    data[-3] ^= 0xFF
    open(f, "wb").write(bytes(data))
    seen = []
    assert ckpt.latest_checkpoint(str(tmp_path / "a"), log=seen.append) == first
    assert seen and "adapter_model.safetensors" in seen[0] and "sha256" in seen[0]


def test_sft_under_lora_saves_its_adapter_and_a_rerun_reuses_it(cfg_factory):
    """The cold start of a LoRA run saves the adapter it trained (sft/model: PEFT's folder with the
    completion marker), a rerun of the folder loads it instead of training SFT again, and the
    folder is a model.path (its base + that adapter)."""
    from safetensors.torch import load_file

    from fastgrpo.pipeline import run_train
    from fastgrpo.runs.checkpoint import is_complete_model_dir

    args = (*LORA, "steps=0", "sft_first=true", "sft.steps=2", "data.num_heldout=0")
    cfg = cfg_factory(*args)
    run_train(cfg, log=_quiet)
    sft = os.path.join(cfg.logging.out_dir, "sft", "model")
    assert lora.is_adapter_dir(sft) and not os.path.exists(os.path.join(sft, "config.json"))
    assert is_complete_model_dir(sft, verify=True)
    logs = []
    run_train(cfg_factory(*args), log=logs.append)
    assert any("skipping the cold start" in m for m in logs), logs
    assert not any("SFT cold start:" in m or "running SFT again" in m for m in logs), logs
    saved = load_file(os.path.join(sft, "adapter_model.safetensors"))
    model, _ = build_model(cfg_factory(*LORA, f"model.path={sft}").model)
    mine = lora.adapter_named_tensors(model)
    assert set(mine) == set(saved) and all(torch.equal(mine[k], saved[k]) for k in saved)
    assert any(float(t.abs().sum()) > 0 for k, t in saved.items() if "lora_B" in k)  # SFT moved the adapter


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_trains_saves_and_resumes_the_adapter(tmp_path, stage):
    """Under DeepSpeed ZeRO-1 / 2 (one gloo process) only the adapter trains and sits in the
    optimizer, the checkpoint holds the adapter folder, and a resumed trainer holds it exactly."""
    import subprocess
    import sys

    env = dict(os.environ, LOCAL_RANK="0", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(29600 + stage + os.getpid() % 200))
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run([sys.executable, os.path.join(here, "_ds_lora_run.py"), str(stage), str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = torch.load(tmp_path / "result.pt", weights_only=False)
    assert all(torch.equal(r["b0"][k], r["b1"][k]) for k in r["b0"]), "a base weight moved"
    assert any(not torch.equal(r["a0"][k], r["a1"][k]) for k in r["a0"]), "the adapter never trained"
    assert all(torch.equal(r["a1"][k], r["a2"][k]) for k in r["a1"]), "the resumed adapter differs from the saved one"
    assert r["step"] == 2 and lora.is_adapter_dir(os.path.join(r["path"], "model"))
    assert r["opt_numel"] == r["adapter_numel"]  # AdamW holds the adapter alone


def test_lora_with_zero3_is_refused_at_load():
    from fastgrpo.config import load_config
    from fastgrpo.trainer.lora_run import check_lora_run

    cfg = load_config(None, ["model.lora.rank=2", "rollout.engine=torch", "distributed.backend=deepspeed",
                             "distributed.zero_stage=3"])
    with pytest.raises(ValueError, match=r"^config distributed.zero_stage=3: expected 0, 1 or 2 with a LoRA policy"):
        check_lora_run(cfg)
