"""Process rewards (fastgrpo/rewards/process.py): step splitting and the steps of tokens, the three
reductions, the group-normalised step advantages, the per-token advantage layout of a packed
batch (plain and shared-prefix) against a hand computation, and every bad input reported or
refused at load with the field's name."""
import math
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from fastgrpo.advantages import step_advantages
from fastgrpo.config import ProcessConfig, RewardsConfig, load_config
from fastgrpo.models.tiny import build_char_tokenizer
from fastgrpo.packing import build_packed_batches
from fastgrpo.packing.layout import unpack
from fastgrpo.rewards.combine import score_groups
from fastgrpo.rewards.process import (StepSplitter, arithmetic_steps, build_process, reduce_steps, token_advantages,
                                      token_offsets, token_steps)
from fastgrpo.rewards.registry import build_rewards

DEMO_REGEX = "<think>.*?</think>|<answer>.*?</answer>"


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


class Task:
    name = "toy"

    def reward_fns(self):
        return {"accuracy": lambda completions, answers: [float(a in c) for c, a in zip(completions, answers)]}


def _comp(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return SimpleNamespace(text=tok.decode(ids, skip_special_tokens=True), token_ids=ids, finish_reason="stop")


def _problem(i, a, b):
    return SimpleNamespace(id=i, key="", prompt=f"{a}+{b}=", answer=str(a + b))


# ---------------------------------------------------------------------------------------- splitting

def test_delimiter_steps_skip_blank_pieces_and_strip_whitespace():
    text = "3x = 22 - 7 = 15\n\n  x = 5 \n2x = 9"
    sp = StepSplitter(delimiter="\n")
    assert sp.split(text) == ["3x = 22 - 7 = 15", "x = 5", "2x = 9"]
    assert sp.spans(text) == [(0, 16), (20, 25), (27, 33)]
    assert StepSplitter(delimiter=" ; ").split("a ; b ;  ; c") == ["a", "b", "c"]


def test_regex_steps_are_the_matches():
    sp = StepSplitter(regex=DEMO_REGEX)
    text = "junk<think>7+12</think>\n<answer>19</answer>tail"
    assert sp.split(text) == ["<think>7+12</think>", "<answer>19</answer>"]
    assert sp.spans(text) == [(4, 23), (24, 43)]
    assert StepSplitter(regex=r"\d+").split("a12b3") == ["12", "3"]


def test_no_steps_is_an_empty_list():
    assert StepSplitter(delimiter="\n").spans(" \n\n \n") == []
    assert StepSplitter(regex=DEMO_REGEX).spans("<think>unclosed") == []
    assert StepSplitter(delimiter="\n").spans("") == []


def test_token_steps_of_the_demo_tokenizer(char_tok):
    c = _comp(char_tok, "ab<think>7+12</think>\n<answer>19</answer>z")
    spans = StepSplitter(regex=DEMO_REGEX).spans(c.text)
    off = token_offsets(char_tok, c.token_ids, c.text)
    assert "".join(c.text[s:e] for s, e in off) == c.text
    steps = token_steps(spans, off).tolist()
    # a, b: before the first step; <think> 7 + 1 2 </think> and the gap "\n": step 0;
    # <answer> 1 9 </answer>: step 1; z after the last step: none; eos (no text) after z: none
    assert steps == [-1, -1] + [0] * 7 + [1] * 4 + [-1, -1]
    c = _comp(char_tok, "<think>7+12</think><answer>19</answer>")
    steps = token_steps(StepSplitter(regex=DEMO_REGEX).spans(c.text), token_offsets(char_tok, c.token_ids, c.text))
    assert steps.tolist() == [0] * 6 + [1] * 5  # eos closes the answer step


def test_token_steps_of_a_hf_fast_tokenizer_agree_with_its_offsets(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    text = "First, 3x = 22 - 7 = 15.\nThen x = 5, café ü 🙂 done.\n\nSo 2x = 9 (wrong)."
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    assert tok.decode(ids) == text
    off = token_offsets(tok, ids, text)
    assert off[0, 0] == 0 and off[-1, 1] == len(text) and bool((off[1:, 0] == off[:-1, 1]).all())
    spans = StepSplitter(delimiter="\n").spans(text)
    assert len(spans) == 3
    ours = token_steps(spans, off)
    # the tokenizer's own offsets: start of the token's first character (a character split over
    # byte tokens repeats its span there; the byte-level trim drops leading spaces, same step)
    theirs = token_steps(spans, np.array(enc["offset_mapping"]))
    assert ours.tolist() == theirs.tolist()
    assert set(ours.tolist()) == {0, 1, 2}
    # the emoji's bytes span several tokens: they all sit in step 1
    emoji = text.index("🙂")
    assert all(k == 1 for (s, e), k in zip(off, ours) if s <= emoji < max(e, s + 1))


# ---------------------------------------------------------------------------------------- reductions

def test_the_chapters_three_reductions():
    # the RLVR chapter: steps 1.0, 1.0, 0.0 → min 0, product 0, mean 0.67
    assert reduce_steps([1.0, 1.0, 0.0], "min") == 0.0
    assert reduce_steps([1.0, 1.0, 0.0], "product") == 0.0
    assert reduce_steps([1.0, 1.0, 0.0], "mean") == pytest.approx(2 / 3)
    assert [reduce_steps([0.9, 0.5, 0.8], r) for r in ("min", "product", "mean")] == pytest.approx(
        [0.5, 0.36, 2.2 / 3])
    with pytest.raises(ValueError, match="reduction='max'"):
        reduce_steps([1.0], "max")


@pytest.mark.parametrize("reduction,want", [("min", [1.0, 0.0, 0.0]), ("product", [1.0, 0.0, 0.0]),
                                            ("mean", [1.0, 0.5, 0.0])])
def test_process_as_an_outcome_reward_by_name(char_tok, reduction, want):
    rcfg = RewardsConfig(functions=["process"], weights=[1.0],
                         process=ProcessConfig(scorer="arithmetic", regex=DEMO_REGEX, reduction=reduction))
    rewards = build_rewards(rcfg, Task(), 24)
    p = _problem(7, 3, 4)
    texts = ["<think>4+3</think><answer>7</answer>", "<think>4+3</think><answer>8</answer>",
             "<think>4+2</think><answer>6</answer>"]
    per_fn, total, dropped, errors = score_groups([p], [[_comp(char_tok, t) for t in texts]], rewards.fns,
                                                  ["process"], [1.0])
    assert per_fn["process"].tolist() == [want] and total.tolist() == [want]
    assert not dropped and not errors and not rewards.process.drain_errors()


def test_arithmetic_scorer():
    steps = ["<think>7+12</think>", "<answer>19</answer>", "<answer>18</answer>", "<think>7+13</think>", "19"]
    assert arithmetic_steps("12+7=", steps, "19") == [1.0, 1.0, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------ step advantages

def test_step_advantages_normalise_over_all_steps_of_a_group():
    s1 = math.sqrt(0.1875)  # σ of [1, 1, 1, 0]
    got = step_advantages([[1, 1], [1, 0], [1, 1], [0, 0], None, [0.5]], 2)
    assert got[0] == pytest.approx([0.25 / (s1 + 1e-4)] * 2)
    assert got[1] == pytest.approx([0.25 / (s1 + 1e-4), -0.75 / (s1 + 1e-4)])
    assert got[2] == pytest.approx([0.5 / 0.5001] * 2) and got[3] == pytest.approx([-0.5 / 0.5001] * 2)
    assert got[4] is None and got[5].tolist() == [0.0]  # a single scored step: σ = 0 → exactly 0
    to_go = step_advantages([[1, 1], [1, 0]], 2, credit="to_go")
    a, b = 0.25 / (s1 + 1e-4), -0.75 / (s1 + 1e-4)
    assert to_go[0] == pytest.approx([2 * a, a]) and to_go[1] == pytest.approx([a + b, b])
    assert step_advantages([[0.3, 0.3], [0.3]], 2)[0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="multiple of group_size"):
        step_advantages([[1.0]], 2)


# --------------------------------------------------------------- per-token advantages, packed

@pytest.mark.parametrize("share", [False, True])
def test_dense_advantages_land_on_their_tokens_in_a_packed_batch(char_tok, share):
    proc = build_process(ProcessConfig(scorer="arithmetic", regex=DEMO_REGEX, dense_weight=0.5))
    problems = [_problem(1, 3, 4), _problem(2, 5, 6)]
    groups = [[_comp(char_tok, "<think>4+3</think><answer>7</answer>"),   # steps 1, 1
               _comp(char_tok, "<think>4+3</think><answer>8</answer>")],  # steps 1, 0
              [_comp(char_tok, "x<think>6+5</think><answer>11</answer>"),  # steps 1, 1 (x: no step)
               _comp(char_tok, "<think>6+4</think><answer>10</answer>")]]  # steps 0, 0
    informative = proc.attach_dense(problems, groups, char_tok)
    assert informative.tolist() == [True, True] and not proc.drain_errors()
    outcome = [0.3, -0.3, 0.7, -0.7]
    # hand computation: group 1's steps [1, 1, 1, 0] (mean 0.75, σ √0.1875), group 2's [1, 1, 0, 0]
    hi1, lo1 = 0.25 / (math.sqrt(0.1875) + 1e-4), -0.75 / (math.sqrt(0.1875) + 1e-4)
    hi2, lo2 = 0.5 / 0.5001, -0.5 / 0.5001
    w = 0.5
    want = [[0.3 + w * hi1] * 5 + [0.3 + w * hi1] * 4,  # <think> 4 + 3 </think> | <answer> 7 </answer> eos
            [-0.3 + w * hi1] * 5 + [-0.3 + w * lo1] * 4,
            [0.7] + [0.7 + w * hi2] * 5 + [0.7 + w * hi2] * 5,  # x | think | <answer> 1 1 </answer> eos
            [-0.7 + w * lo2] * 5 + [-0.7 + w * lo2] * 5]
    comps = [c for g in groups for c in g]
    advs = [token_advantages(a, c) for a, c in zip(outcome, comps)]
    prompt_ids = [char_tok(p.prompt, add_special_tokens=False)["input_ids"] for p in problems]
    prompts = [prompt_ids[0]] * 2 + [prompt_ids[1]] * 2
    (batch,) = build_packed_batches(prompts, [c.token_ids for c in comps], advs, 4096, group_size=2,
                                    share_prefix=share, attn_coef=1e6)
    if share:  # both groups carry their prompt once: 2 prompt segments + 4 completion segments
        assert batch.segment_prefix is not None and int((batch.segment_prefix[:, 1] > 0).sum()) == 4
        assert batch.num_tokens == sum(len(p) for p in prompt_ids) + sum(len(c.token_ids) for c in comps)
    per_seq = unpack(batch, batch.advantages)
    for s, i in enumerate(batch.seq_index.tolist()):
        np.testing.assert_allclose(per_seq[s].numpy(), np.array(want[i], dtype=np.float32), rtol=1e-6, atol=1e-6)
    # the loss reads the advantage at completion token n; its target is that token
    assert batch.targets.tolist() == [t for i in batch.seq_index.tolist() for t in comps[i].token_ids]


def test_a_group_with_equal_step_scores_gets_no_dense_advantage(char_tok):
    proc = build_process(ProcessConfig(scorer="arithmetic", regex=DEMO_REGEX, dense_weight=1.0))
    groups = [[_comp(char_tok, "<think>4+3</think><answer>7</answer>")] * 2]
    assert proc.attach_dense([_problem(1, 3, 4)], groups, char_tok).tolist() == [False]
    assert all(float(np.abs(c.step_advantages).max()) == 0.0 for c in groups[0])
    assert token_advantages(0.25, SimpleNamespace()) == 0.25  # no dense advantage: the float itself


# --------------------------------------------------------------------------------------- bad input

def _scorer_file(tmp_path, body):
    f = tmp_path / "scorer.py"
    f.write_text(textwrap.dedent(body))
    return f"{f}:score"


def test_bad_runtime_scores_are_reported_per_completion(char_tok, tmp_path):
    path = _scorer_file(tmp_path, """
        def score(prompt, steps, answer):
            if "boom" in steps[0]:
                raise RuntimeError("scorer down")
            if "short" in steps[0]:
                return [1.0]
            if "nan" in steps[0]:
                return [float("nan")] * len(steps)
            return [1.0] * len(steps)
    """)
    rcfg = RewardsConfig(functions=["accuracy", "process"], weights=[1.0, 1.0], error_score=-1.0,
                         process=ProcessConfig(scorer=path, delimiter="\n", dense_weight=1.0))
    rewards = build_rewards(rcfg, Task(), 24)
    problems = [_problem(11, 3, 4), _problem(12, 1, 1)]
    groups = [[_comp(char_tok, "ok\n7"), _comp(char_tok, "boom\n7")],
              [_comp(char_tok, "short\nx\ny"), _comp(char_tok, "\n\n"), ]]
    per_fn, total, dropped, errors = score_groups(problems, groups, rewards.fns, rcfg.functions, rcfg.weights,
                                                  error_score=-1.0)
    # one line for the reward (the first failure, the count), reported once by the scoring path
    assert len(errors) == 1 and "prompt id 11: the scorer raised RuntimeError: scorer down (completion 1)" in errors[0]
    assert "3 of 4 completions failed" in errors[0] and "scored rewards.error_score" in errors[0]
    assert rewards.process.drain_errors() == []
    why = [r.error for r in rewards.process.results_for(problems, groups)]  # each completion keeps its reason
    assert why[0] is None and "raised RuntimeError: scorer down" in why[1]
    assert "returned 1 scores for 3 steps" in why[2] and "found no steps" in why[3]
    assert per_fn["process"].tolist() == [[1.0, -1.0], [-1.0, -1.0]]  # the good completion keeps its score
    # dense: the failed completions get no step advantage, the good one's group has nothing to compare
    informative = rewards.process.attach_dense(problems, groups, char_tok)
    assert informative.tolist() == [False, False]
    assert all(float(np.abs(c.step_advantages).max()) == 0.0 for g in groups for c in g)
    nan = [[_comp(char_tok, "nan\n1")]]
    rewards.process.results_for([problems[0]], nan)
    assert "non-finite" in rewards.process.drain_errors()[0]


@pytest.mark.parametrize("override,field", [
    ("rewards.process.regex='<think>(.*'", "rewards.process.regex"),
    ("rewards.process.reduction=max", "rewards.process.reduction"),
    ("rewards.process.dense_credit=all", "rewards.process.dense_credit"),
    ("rewards.process.dense_weight=-1", "rewards.process.dense_weight"),
    ("rewards.process.delimiter=''", "rewards.process.delimiter"),
])
def test_bad_process_config_fails_at_load_naming_the_field(override, field):
    with pytest.raises(ValueError, match=f"config {field}="):
        load_config(None, ["rewards.process.scorer=arithmetic", override])


def test_a_process_reward_needs_a_scorer():
    with pytest.raises(ValueError, match="config rewards.process.scorer=''.*rewards.functions lists 'process'"):
        load_config(None, ["rewards.functions=[accuracy, process]", "rewards.weights=[1.0, 1.0]"])
    with pytest.raises(ValueError, match="config rewards.process.scorer=''.*dense_weight"):
        load_config(None, ["rewards.process.dense_weight=0.5"])


def test_a_scorer_that_does_not_import_fails_in_build_rewards(tmp_path):
    for scorer, why in [("no_such_module_xyz:score", "cannot import 'no_such_module_xyz'"),
                        (f"{tmp_path}/missing.py:score", "no file"),
                        (_scorer_file(tmp_path, "x = 1\n").replace(":score", ":nope"), "has no callable 'nope'"),
                        ("builtin_that_is_not", "expected a built-in scorer among ['arithmetic']")]:
        cfg = load_config(None, [f"rewards.process.scorer={scorer}", "rewards.process.dense_weight=1"])
        with pytest.raises(ValueError, match="config rewards.process.scorer") as e:
            build_rewards(cfg.rewards, Task(), 24)
        assert why in str(e.value)


def test_the_run_loader_refuses_a_bad_scorer_before_any_model(tmp_path):
    from fastgrpo.pipeline import load_run

    cfg = load_config(None, ["rewards.process.scorer=no_such_module_xyz:score", "rewards.process.dense_weight=1",
                             f"logging.out_dir={tmp_path}/run"])
    with pytest.raises(ValueError, match="config rewards.process.scorer: 'no_such_module_xyz:score': cannot import"):
        load_run(cfg, log=lambda m: None)
    assert not (tmp_path / "run").exists()  # nothing of the run was started


def test_the_batched_token_values_match_token_steps_one_completion_at_a_time():
    from fastgrpo.rewards.process import batch_token_values

    rng = np.random.default_rng(0)
    spans, values, lengths, text_lens, want = [], [], [], [], []
    for j in range(60):
        n = int(rng.integers(0, 30)) if j else 0  # a completion with no tokens too
        lens = rng.integers(0, 4, size=n)  # zero-width tokens (eos) too
        text_len = max(1, int(lens.sum()) - int(rng.integers(0, 3)))  # sometimes shorter: clamped
        ends = np.minimum(np.cumsum(lens), text_len)
        off = np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1) if n else np.zeros((0, 2), np.int64)
        cuts = np.sort(rng.choice(np.arange(text_len + 2), size=min(int(rng.integers(2, 8)), text_len + 2), replace=False))
        sp = [(int(a), int(b)) for a, b in zip(cuts[::2], cuts[1::2]) if b > a] or [(0, 1)]
        v = rng.normal(size=len(sp))
        k = token_steps(sp, off)
        spans.append(sp), values.append(v), lengths.append(lens.tolist()), text_lens.append(text_len)
        want.append(np.where(k >= 0, v[np.maximum(k, 0)], 0.0))
    got = batch_token_values(spans, values, lengths, text_lens)
    assert len(got) == 60 and sum(bool(np.any(w == 0) and np.any(w != 0)) for w in want) > 10
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("credit", ["step", "to_go"])
def test_step_advantages_match_a_group_by_group_reference(credit):
    rng = np.random.default_rng(1)
    G = 4
    scores = []
    for j in range(40):
        k = int(rng.integers(0, 5))
        scores.append(None if k == 0 else rng.choice([0.0, 0.5, 1.0], size=k).tolist())
    scores[8:12] = [[1.0, 1.0], [1.0], None, [1.0]]  # a σ = 0 group
    got = step_advantages(scores, G, credit=credit)
    for g in range(0, 40, G):
        flat = [v for x in scores[g:g + G] if x for v in x]
        for j in range(g, g + G):
            if not scores[j]:
                assert got[j] is None
                continue
            s = np.array(scores[j])
            a = np.zeros_like(s) if len(set(flat)) == 1 else (s - np.mean(flat)) / (np.std(flat) + 1e-4)
            want = np.cumsum(a[::-1])[::-1] if credit == "to_go" else a
            np.testing.assert_allclose(got[j], want, rtol=1e-12, atol=1e-12)
    assert got[8].tolist() == [0.0, 0.0]


def test_dense_steps_alone_report_no_missing_steps_and_log_their_metrics(char_tok):
    """With `process` not among rewards.functions (dense step advantages alone) a completion
    without steps is no reward error (it only gets no step advantage), and the step metrics reach
    the rewards' metrics (metrics.jsonl) either way (issue 34)."""
    pc = ProcessConfig(scorer="arithmetic", regex=DEMO_REGEX, dense_weight=1.0)
    dense = build_rewards(RewardsConfig(functions=["accuracy"], weights=[1.0], process=pc), Task(), 24)
    groups = [[_comp(char_tok, "<think>4+3</think><answer>7</answer>"), _comp(char_tok, "7")]]
    dense.process.attach_dense([_problem(1, 3, 4)], groups, char_tok)
    assert dense.process.drain_errors() == []
    m = dense.metrics()
    assert m["process/no_steps"] == 0.5 and m["process/steps_mean"] == 1.0 and m["process/failed"] == 0.0
    assert m["process/step_score_mean"] == 1.0
    outcome = build_rewards(RewardsConfig(functions=["process"], weights=[1.0], process=pc), Task(), 24)
    outcome.process.results_for([_problem(1, 3, 4)], groups)
    assert "found no steps" in outcome.process.drain_errors()[0]  # scored rewards.error_score: reported
    assert outcome.metrics()["process/no_steps"] == 0.5
