"""The engine-independent parts of the rollout interface: sampling-config validation, prompt
handling, grouping by prompt, the thinking budget (on a scripted engine), make_engine."""
import pytest

from fastgrpo.rollout import Completion, RolloutEngine, SamplingConfig, make_engine
from fastgrpo.rollout.base import DEFAULT_INTERRUPT


class CharTok:
    """One id per character; enough for the base class's encode/decode."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class Scripted(RolloutEngine):
    """Emits `script(prompt_ids, max_new_tokens)` and records every call."""

    def __init__(self, script):
        self.tokenizer = CharTok()
        self.script = script
        self.calls = []

    def _sample(self, prompt_ids, sampling, max_new_tokens, seeds):
        self.calls.append((prompt_ids, max_new_tokens, seeds))
        out = []
        for p in prompt_ids:
            toks, reason = self.script(p, max_new_tokens)
            out.append(Completion(toks, [-0.5] * len(toks), reason, self._decode(toks)))
        return out

    def update_weights(self, model_or_named):
        return None


def _enc(s):
    return [ord(c) for c in s]


def test_groups_and_seeds():
    eng = Scripted(lambda p, m: (_enc("ab"), "stop"))
    out = eng.generate(["x", [120, 121]], n=3, sampling=SamplingConfig(seed=10))
    assert [len(g) for g in out] == [3, 3]
    assert all(c.prompt_index == i for i, g in enumerate(out) for c in g)
    prompts, _, seeds = eng.calls[0]
    assert prompts == [[120]] * 3 + [[120, 121]] * 3
    assert seeds == [10, 11, 12, 13, 14, 15]


def test_thinking_budget_interrupts_and_continues():
    def script(p, m):
        if m == 5:                                   # thinking phase: never closes </think>
            return _enc("think"), "length"
        return _enc("42"), "stop"                     # answer phase

    eng = Scripted(script)
    s = SamplingConfig(thinking_budget=5, answer_budget=7, interrupt="!</think>")
    c = eng.generate(["q"], sampling=s)[0][0]
    assert c.text == "think!</think>42"
    assert c.sampled_mask == [1] * 5 + [0] * len("!</think>") + [1, 1]
    assert c.logprobs[5:5 + len("!</think>")] == [0.0] * len("!</think>")
    assert c.finish_reason == "stop"
    cont_prompt, budget, _ = eng.calls[1]
    assert budget == 7 and cont_prompt == [_enc("q") + _enc("think!</think>")]


def test_thinking_budget_closed_or_stopped_is_not_interrupted():
    def script(p, m):
        if m == 6:
            return (_enc("a</think>") if p == _enc("p") else _enc("ok")), ("length" if p == _enc("p") else "stop")
        return _enc("A"), "length"

    eng = Scripted(script)
    out = eng.generate(["p", "q"], sampling=SamplingConfig(thinking_budget=6, think_end="</think>"))
    closed, stopped = out[0][0], out[1][0]
    assert closed.text == "a</think>A" and DEFAULT_INTERRUPT not in closed.text
    assert closed.finish_reason == "length" and all(closed.sampled_mask)
    assert stopped.text == "ok" and len(eng.calls[1][0]) == 1


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop=("",)), "stop"), (dict(seed="1"), "seed"),
    (dict(thinking_budget=0), "thinking_budget"), (dict(answer_budget=0), "answer_budget"),
])
def test_sampling_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def test_bad_prompts_and_n():
    eng = Scripted(lambda p, m: ([], "stop"))
    with pytest.raises(ValueError, match="n=0"):
        eng.generate(["a"], n=0)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        eng.generate(["a", []])
    with pytest.raises(ValueError, match="list of strings"):
        eng.generate("abc")


def test_make_engine_rejects_unknown_kind_and_missing_model():
    with pytest.raises(ValueError, match="kind='sglang'"):
        make_engine("sglang", model=object())
    with pytest.raises(ValueError, match="model"):
        make_engine("torch")
