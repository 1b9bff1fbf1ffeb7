"""The TRL drop-in: TRL's GRPOTrainer computing its loss with fastgrpo.

1. On the same padded batch and the same tiny float64 model, `fastgrpo_compute_loss` returns
   TRL 1.16's `_compute_loss` loss, parameter gradients and logged metrics for grpo, bnpo,
   dr_grpo and dapo (with ε_high, δ, β·k3 and the vLLM importance weights).
2. `FastGRPOTrainer` trains 2 steps end to end (generation, rewards, loss, optimizer) with every
   loss computed by fastgrpo.
"""
import os
import types
from collections import defaultdict

import pytest
import torch

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from fastgrpo.models.tiny import build_tiny_model  # noqa: E402
from fastgrpo.integrations.trl import FastGRPOTrainer, _install_forward, fastgrpo_compute_loss, patch_trl_loss  # noqa: E402

from _trl_stand_in import GA, SPG, TAU, C, padded_batch  # noqa: E402
from _trl_stand_in import StandInAccelerator as _Accelerator  # noqa: E402


def _stand_in(model, loss_type, level, eps_high, delta, beta, bias_kl):
    """The attributes of a GRPOTrainer that `_compute_loss` reads, around a real model."""
    args = types.SimpleNamespace(use_bias_correction_kl=bias_kl, delta=delta, steps_per_generation=SPG,
                                 cast_lm_head_to_fp32=False)
    t = types.SimpleNamespace(
        model=model, args=args, loss_type=loss_type, importance_sampling_level=level, beta=beta,
        epsilon_low=0.2, epsilon_high=eps_high, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        use_vllm=True, vllm_importance_sampling_correction=True, current_gradient_accumulation_steps=GA,
        accelerator=_Accelerator(), _entropy_bonus_enabled=False, aux_loss_enabled=False, temperature=TAU,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, max_completion_length=C,
    )
    get = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies
    t._get_per_token_logps_and_entropies = types.MethodType(getattr(get, "__wrapped__", get), t)
    t._trl_compute_loss = types.MethodType(trl_grpo.GRPOTrainer._compute_loss, t)
    return t


@pytest.fixture(scope="module")
def setup():
    model, _ = build_tiny_model("qwen2", seed=0, dtype=torch.float64, num_hidden_layers=1)
    model.train()
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))  # as GRPOTrainer does
    _install_forward(model)
    inputs, lengths = padded_batch(model)
    return model, inputs


def _loss_and_grads(fn, model, inputs):
    model.zero_grad()
    loss = fn(model, inputs)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES = [  # loss_type, importance level, eps_high, delta, beta, use_bias_correction_kl
    ("grpo", "token", 0.28, 1.5, 0.04, True),
    ("bnpo", "token", 0.28, 1.5, 0.04, True),
    ("dr_grpo", "token", 0.28, 1.5, 0.04, True),
    ("dapo", "token", 0.28, 1.5, 0.04, True),
    ("dapo", "token", 0.2, None, 0.0, False),
    ("grpo", "sequence", 0.28, None, 0.04, False),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_drop_in_equals_trl_loss_grads_metrics(setup, case):
    model, inputs = setup
    trl_t, ours_t = _stand_in(model, *case), _stand_in(model, *case)
    trl_loss, g_trl = _loss_and_grads(trl_t._trl_compute_loss, model, inputs)
    loss, g = _loss_and_grads(lambda m, x: fastgrpo_compute_loss(ours_t, m, x), model, inputs)
    assert ours_t._fastgrpo_calls == 1 and not getattr(ours_t, "_fastgrpo_fallbacks", 0)
    assert trl_loss != 0.0 and abs(loss - trl_loss) <= 1e-6, (loss, trl_loss)
    assert set(g) == set(g_trl)
    for name, gt in g_trl.items():
        err = float((g[name] - gt).abs().max())
        assert err <= 1e-6, f"grad {name}: max error {err:.3e}"
    m_trl = {k: v[-1] for k, v in trl_t._metrics["train"].items()}
    m_ours = {k: v[-1] for k, v in ours_t._metrics["train"].items() if not k.startswith("fastgrpo/")}
    assert set(m_ours) == set(m_trl)
    assert ours_t._metrics["train"]["fastgrpo/fallback_frac"] == [0.0]
    for k in m_trl:
        assert m_ours[k] == pytest.approx(m_trl[k], abs=1e-6), k


def test_unsupported_configuration_falls_back_to_trl(setup):
    """An option outside fastgrpo (here a loss type TRL 1.16 does not know either) goes to TRL's
    own loss, warned once naming it and counted; TRL's own error is what the user sees."""
    model, inputs = setup
    t = _stand_in(model, "grpo", "token", 0.28, None, 0.0, False)
    t.loss_type = "not_a_loss"
    with pytest.warns(UserWarning, match="not_a_loss"), pytest.raises(ValueError, match="Unknown loss type"):
        fastgrpo_compute_loss(t, model, inputs)


def test_patch_rejects_non_trainer():
    with pytest.raises(ValueError, match="trl.GRPOTrainer"):
        patch_trl_loss(object())


def test_fast_trainer_trains_two_steps(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = build_tiny_model("qwen2", seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]})

    def digits(completions, **kw):  # rewards digit-heavy completions: varied, so advantages ≠ 0
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, max_completion_length=6, num_generations=4,
                      per_device_train_batch_size=4, gradient_accumulation_steps=1, max_steps=2,
                      learning_rate=1e-2, loss_type="dapo", beta=0.0, report_to="none", logging_steps=1,
                      save_strategy="no", temperature=1.0, use_cpu=True, bf16=False, seed=0,
                      dataloader_num_workers=0)
    trainer = FastGRPOTrainer(model=model, reward_funcs=digits, args=args, train_dataset=prompts,
                              processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer._fastgrpo_calls >= 2 and trainer._fastgrpo_fallbacks == 0
    stats = trainer.fastgrpo_stats
    assert stats.fused == trainer._fastgrpo_calls and not stats.fallback
    logged = [h for h in trainer.state.log_history if "fastgrpo/microbatches_fastgrpo" in h]
    assert logged and logged[-1]["fastgrpo/microbatches_fastgrpo"] == stats.computed
    assert logged[-1]["fastgrpo/fallback_frac"] == 0.0
    changed = max(float((p.detach() - before[n]).abs().max()) for n, p in trainer.model.named_parameters())
    assert changed > 1e-4, "weights did not change"
    assert any("clip_ratio/low_mean" in h for h in trainer.state.log_history)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_eval_before_training_without_accumulation_attribute(setup, loss_type):
    """`evaluate()` before training / `eval_on_start=True`: transformers has not set
    `current_gradient_accumulation_steps` yet; TRL's loss divides by 1 in eval, and so does ours."""
    model, inputs = setup
    trl_t, ours_t = (_stand_in(model, loss_type, "token", 0.28, None, 0.04, True) for _ in range(2))
    for t in (trl_t, ours_t):
        del t.current_gradient_accumulation_steps
        t.args.gradient_accumulation_steps = GA
    model.eval()
    try:
        with torch.no_grad():
            trl_loss = float(trl_t._trl_compute_loss(model, inputs))
            loss = float(fastgrpo_compute_loss(ours_t, model, inputs))
    finally:
        model.train()
    assert ours_t._fastgrpo_calls == 1 and not getattr(ours_t, "_fastgrpo_fallbacks", 0)
    assert trl_loss != 0.0 and abs(loss - trl_loss) <= 1e-6, (loss, trl_loss)
    ours_eval = {k for k in ours_t._metrics["eval"] if not k.startswith("fastgrpo/")}
    assert ours_eval == set(trl_t._metrics["eval"]) and not ours_t._metrics["train"]


def test_fast_trainer_objective_path_with_accumulation_and_eval(tmp_path):
    """The real GRPOTrainer around the TRL-objective path: evaluate() before training (no
    current_gradient_accumulation_steps yet), then 2 steps with gradient accumulation 2, cispo with
    the entropy bonus and entropy-quantile masking; every micro-batch on fastgrpo's head."""
    from datasets import Dataset
    from trl import GRPOConfig

    model, tok = build_tiny_model("qwen2", seed=0)
    prompts = Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]})

    def digits(completions, **kw):
        return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, max_completion_length=6, num_generations=4,
                      per_device_train_batch_size=4, per_device_eval_batch_size=4, gradient_accumulation_steps=2,
                      max_steps=2, learning_rate=1e-2, loss_type="cispo", entropy_coef=0.01,
                      top_entropy_quantile=0.5, beta=0.0, report_to="none", logging_steps=1, save_strategy="no",
                      temperature=1.0, use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    trainer = FastGRPOTrainer(model=model, reward_funcs=digits, args=args, train_dataset=prompts,
                              eval_dataset=prompts, processing_class=tok)
    ev = trainer.evaluate()
    assert "eval_loss" in ev and ev["eval_fastgrpo/fallback_frac"] == 0.0
    trainer.train()
    stats = trainer.fastgrpo_stats
    assert trainer.state.global_step == 2 and not stats.fallback and stats.fused == 0
    assert stats.objective["loss_type='cispo'"] == stats.computed >= 5  # 1 eval + 2 steps × 2 accumulated
    row = [h for h in trainer.state.log_history if "fastgrpo/microbatches_fastgrpo" in h][-1]
    assert row["fastgrpo/microbatches_fastgrpo"] == stats.computed and row["fastgrpo/microbatches_fallback"] == 0
    assert row["fastgrpo/objective/loss_type_cispo"] == stats.computed


@pytest.mark.parametrize("fp32_head", [False, True], ids=["autocast-head", "cast_lm_head_to_fp32"])
def test_fused_path_under_autocast(fp32_head):
    """TRL's default bf16=True runs `_compute_loss` under the accelerator's autocast (on CPU too:
    TRL's CPU tests set use_cpu with bf16). The fused kernel writes its gradients into buffers of
    the inputs' dtype, which autocast's bf16 matmuls do not match: it raised 'Expected out tensor
    to have dtype c10::BFloat16' (found by TRL's own test_train on the drop-in). Now the head runs
    in the autocast dtype as TRL's does (fp32 with cast_lm_head_to_fp32), autocast off in the kernel."""
    model, _ = build_tiny_model("qwen2", seed=0, dtype=torch.float32, num_hidden_layers=1)
    model.train()
    add_fused_lm_head(model, temperature=TAU, outputs=("log_probs", "entropy"))
    _install_forward(model)
    inputs, _ = padded_batch(model)
    trl_t, ours_t = (_stand_in(model, "dapo", "token", 0.28, None, 0.04, True) for _ in range(2))
    for t in (trl_t, ours_t):
        t.accelerator.autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
        t.args.cast_lm_head_to_fp32 = fp32_head
    trl_loss, g_trl = _loss_and_grads(trl_t._trl_compute_loss, model, inputs)
    loss, g = _loss_and_grads(lambda m, x: fastgrpo_compute_loss(ours_t, m, x), model, inputs)
    assert ours_t.fastgrpo_stats.fused == 1
    assert abs(loss - trl_loss) <= 2e-2 * max(1.0, abs(trl_loss)), (loss, trl_loss)
    assert set(g) == set(g_trl)
    for name, gt in g_trl.items():
        cos = torch.nn.functional.cosine_similarity(g[name].flatten().double(), gt.flatten().double(), dim=0)
        assert bool(torch.isfinite(g[name]).all()) and float(cos) > 0.98, (name, float(cos))


def test_unknown_compute_loss_arguments_fall_back_to_trl_warned_once(setup):
    """A TRL whose `_compute_loss` passes more than (model, inputs) (the signature has been
    (model, inputs) throughout TRL 1.x): fastgrpo does not guess what they mean; TRL computes
    those micro-batches, warned once naming the argument, counted."""
    from fastgrpo.integrations.trl import _compute_loss_entry

    model, inputs = setup
    t = _stand_in(model, "dapo", "token", 0.28, None, 0.0, False)
    seen = []
    t._trl_compute_loss = lambda m, x, *a, **kw: seen.append(kw) or torch.tensor(1.5)
    with pytest.warns(UserWarning, match="num_items_in_batch"):
        loss = _compute_loss_entry(t, model, inputs, num_items_in_batch=7)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compute_loss_entry(t, model, inputs, num_items_in_batch=7)  # no second warning
    assert float(loss) == 1.5 and seen == [{"num_items_in_batch": 7}] * 2
    assert sum(t.fastgrpo_stats.fallback.values()) == 2 and t.fastgrpo_stats.computed == 0


def test_patch_warns_when_trl_routes_the_loss_to_liger(monkeypatch):
    """TRL 1.0-1.9 send every micro-batch to `compute_liger_loss` when use_liger_kernel=True,
    bypassing `_compute_loss`: the drop-in says so instead of silently computing nothing."""
    model, _ = build_tiny_model("qwen2", seed=0, num_hidden_layers=1)
    monkeypatch.setattr(trl_grpo.GRPOTrainer, "compute_liger_loss", lambda self, m, x: None, raising=False)
    t = object.__new__(trl_grpo.GRPOTrainer)
    t.model, t.use_liger_kernel, t.train = model, True, lambda: None
    with pytest.warns(UserWarning, match="use_liger_kernel=True"):
        patch_trl_loss(t)


# ------------------------------------------------ the runner of TRL's own GRPO suite (benchmarks/trl_suite)


def test_trl_suite_runner_refuses_a_missing_trl_path(tmp_path):
    from benchmarks.trl_suite.run import find_test_file

    with pytest.raises(SystemExit, match="--trl PATH is required"):
        find_test_file(None)
    with pytest.raises(SystemExit, match="no TRL GRPO test file"):
        find_test_file(str(tmp_path / "no-trl-here"))


_TOY_TRL_TEST = '''
import os

from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOTrainer

from .testing_utils import is_joblib_available  # noqa: F401  (absent from TRL 1.16: the plugin adds it)


def test_stand_ins_answer_the_hub_ids():
    ds = load_dataset("trl-internal-testing/zen", "standard_prompt_only", split="train")
    assert len(ds) == 17 and ds.column_names == ["prompt"] and isinstance(ds[0]["prompt"], str)
    conv = load_dataset("trl-internal-testing/zen", "conversational_prompt_only", streaming=True)
    assert next(iter(conv["test"]))["prompt"][0]["role"] == "user"
    model = AutoModelForCausalLM.from_pretrained("trl-internal-testing/tiny-Gemma2ForCausalLM")
    tok = AutoTokenizer.from_pretrained("trl-internal-testing/tiny-Gemma2ForCausalLM")
    assert type(model).__name__ == "Gemma2ForCausalLM" and str(model.dtype) == "torch.bfloat16"
    assert model.config.vocab_size >= len(tok) and "<start_of_turn>" in tok.chat_template


def test_trainer_is_substituted():
    assert (GRPOTrainer.__name__ == "FastGRPOTrainer") == (os.environ["FASTGRPO_TRL_SUITE_TRAINER"] == "fastgrpo")


def test_passes_with_stock_only():
    assert GRPOTrainer.__name__ == "GRPOTrainer"
'''


def test_trl_suite_runner_plumbing_on_a_toy_suite(tmp_path, capsys):
    """The runner stages a TRL tests folder, builds the stand-in it names, runs it with both
    trainers (offline hub cache, zen datasets, trainer substitution, import_utils shim) and
    reports the test that passes only with stock GRPOTrainer."""
    from benchmarks.trl_suite.run import main

    tests = tmp_path / "trl" / "tests"
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    (tests / "conftest.py").write_text("")
    (tests / "testing_utils.py").write_text("from trl.import_utils import is_joblib_available, is_vllm_available\n")
    (tests / "test_grpo_trainer.py").write_text(_TOY_TRL_TEST)
    rc = main(["--trl", str(tmp_path / "trl"), "--work", str(tmp_path / "work"), "--threads", "1"])
    out = capsys.readouterr().out
    assert "stock GRPOTrainer: 3 ran / 3 passed / 0 failed / 0 skipped" in out, out
    assert "FastGRPOTrainer: 3 ran / 2 passed / 1 failed / 0 skipped" in out, out
    assert rc == 1 and "test_grpo_trainer.py::test_passes_with_stock_only" in out.split("but not with")[1]
    built = os.listdir(tmp_path / "work" / "hub")
    assert built == ["models--trl-internal-testing--tiny-Gemma2ForCausalLM"], built  # only what the file names


def test_trl_suite_qwen_stand_in_tokenizer_keeps_the_ids_trl_tests_hard_code():
    from benchmarks.trl_suite.stand_ins import build_tokenizer

    tok = build_tokenizer("qwen3")
    assert len(tok) == 151669 and (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    call = [151657, 198, 4913, 606, 788, 330, 7692, 93054, 22785, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11,
            330, 65, 788, 220, 19, 11248, 151658, 151645]
    assert tok.decode(call) == '<tool_call>\n{"name": "async_multiply_tool", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    assert tok.decode([40, 2765, 944, 16252, 151645, 151643], skip_special_tokens=True) == "I won't increment"
    assert tok.decode([17453, 0, 151645]) == "Done!<|im_end|>"
    assert tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]


def test_trl_suite_counts_loss_paths_per_test():
    """The suite's FastGRPOTrainer run records, per test, the micro-batches of each path; the
    runner's line counts the tests that ran fastgrpo's loss and those that fell back, by reason."""
    from benchmarks.trl_suite.run import loss_paths, path_line
    from fastgrpo.integrations.trl import FastGRPOStats

    a, b = FastGRPOStats(), FastGRPOStats()
    a.fused, a.objective["entropy_coef"] = 3, 2
    b.fallback["loss_type_foo"] = 4
    got = loss_paths([types.SimpleNamespace(fastgrpo_stats=a), types.SimpleNamespace(fastgrpo_stats=b), object()])
    assert got == {"fused": 3, "objective": 2, "fallback": 4, "reasons": {"loss_type_foo": 4}}
    none = {"fused": 0, "objective": 0, "fallback": 0, "reasons": {}}
    line = path_line({"t1": got, "t2": {**none, "fused": 1}, "t3": none})
    assert line == ("FastGRPOTrainer loss paths: 2 tests ran fastgrpo's loss; 1 fell back to TRL's loss "
                    "(loss_type_foo: 1 tests)"), line
