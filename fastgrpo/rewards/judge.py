"""Model-backed rewards for prompts without a verifier: a sequence-classification reward model, a
generative judge, and the math accuracy that asks a judge only when symbolic parsing fails.

The stage after RLVR in DeepSeek-R1 (§2.3.4: "reward models to capture human preferences" on
general prompts), Kimi K1.5 and Qwen3 (general RL with a reward model / LLM judge) scores
completions of open-ended prompts with learned models; Kimi also uses a learned model for math
answer equivalence where regex and SymPy fail on notation variants. Here:

- `RewardModelReward` (`kind: classifier`): any HF `AutoModelForSequenceClassification` folder with
  one logit (the Bradley–Terry reward models of TRL's RewardTrainer / OpenRLHF). The text scored
  is the (prompt, completion) conversation rendered by the reward model's *own* chat template
  when its tokenizer has one (the user turn is the row's `prompt` / `messages` column when the
  problem keeps it, else the policy's prompt text), otherwise prompt + completion as plain text;
  long texts are cut from the left so the completion stays. `normalize: group` replaces each score
  by its z-score within its group of G, `(s − μ_g) / σ_g` (population σ), so that an RM's arbitrary
  scale weighs like a 0/1 verifier in `rewards.weights`; a group whose scores are all equal
  (σ_g < 1e-6) scores 0 everywhere: it carries no preference (GRPO drops such a group anyway
  unless other rewards vary in it).
- `JudgeReward` (`kind: judge`): a causal LM asked `rubric` (a template with {prompt}, {completion},
  {answer}; its chat template applied when it has one). `score: logprobs` (the default) reads the
  next-token distribution p after the rubric and scores `Σ_i v_i p(t_i) / Σ_i p(t_i)` over the
  answer labels t_i ("0".."9", or "no"/"yes" with values 0/1): the expected value of the judge's
  answer restricted to the labels, as G-Eval does; a label that is not one token of the judge's
  vocabulary is a load-time error. When the labels hold less than `min_mass` of the
  probability the judge did not answer in the labels: the item has no score (None →
  `rewards.error_score`), counted in `reward/<name>/unparsable`, written to the run log each call
  and said on the console once when more than half of a call's answers are unparsable. `score: generate` decodes
  greedily and takes the first label (as a word) or else the first number of the text.
- `JudgedAccuracy` (`rewards.accuracy_judge: <judge>`): the math verifier first; the judge is
  asked only for completions whose extracted answer did not parse as mathematics (reason
  `unparsable`: never for wrong, missing or timed-out answers), with {completion} = the extracted
  answer and {answer} = the reference; a judge score at or above the midpoint of its values counts
  as correct. `reward/accuracy/judge_asked` counts the asks of a step.

Departures: the models run in the trainer process on their own device (`device`), batched
(`batch_size`), never in the verifier pool (a model per worker would cost its memory each); the
judge is scored with HF transformers, not the rollout engine (the engines sample, they do not
return a next-token distribution over chosen labels). A folder that does not load is a load-time
ValueError naming the reward and the path; models are loaded once per process (`load_model_reward`
keeps them by config).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger("fastgrpo.rewards")

_LOADED: Dict[tuple, object] = {}
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")
_FIELDS = ("prompt", "completion", "answer")


def group_normalize(scores: Sequence[Optional[float]], group_size: int) -> List[Optional[float]]:
    """z-score of each score within its group of `group_size` (consecutive items); None stays None
    and is left out of μ and σ; a group with σ < 1e-6 (or one score) scores 0.0."""
    out: List[Optional[float]] = list(scores)
    g = max(1, int(group_size))
    for start in range(0, len(out), g):
        idx = [i for i in range(start, min(start + g, len(out))) if out[i] is not None]
        vals = [float(out[i]) for i in idx]
        if not vals:
            continue
        mu = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals))
        for i, v in zip(idx, vals):
            out[i] = (v - mu) / sd if sd >= 1e-6 else 0.0
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _device(name: str, spec: str):
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError):
        raise ValueError(f"config rewards.models.{name}.device={spec!r}: expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"config rewards.models.{name}.device={spec!r}: this machine has {n} CUDA device(s)")
    return dev


def _user_turns(problem) -> List[dict]:
    """The problem's user turns for a reward model's own chat template: its raw `prompt` /
    `messages` column when the row keeps it, else its prompt text as one user turn."""
    row = getattr(problem, "row", None) or {}
    for col in ("prompt", "messages"):
        value = row.get(col)
        if isinstance(value, str) and value.strip():
            return [{"role": "user", "content": value}]
        if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
            turns = [{"role": m["role"], "content": m.get("content", "")} for m in value]
            return turns[:-1] if turns[-1]["role"] == "assistant" and len(turns) > 1 else turns  # not the reference reply
    return [{"role": "user", "content": getattr(problem, "prompt", "")}]


class _ModelReward:
    """Shared loading, tokenizing and metrics of both kinds."""

    takes_inputs = True  # called with the whole RewardInputs (fastgrpo.rewards.registry.inputs_reward)
    auto_class = "AutoModelForCausalLM"
    padding_side = "left"

    def __init__(self, name: str, mcfg):
        import torch
        import transformers

        self.name, self.cfg = name, mcfg
        self.device = _device(name, mcfg.device)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[mcfg.dtype]
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(mcfg.path)
            model = getattr(transformers, self.auto_class).from_pretrained(mcfg.path, dtype=dtype)
        except Exception as e:  # noqa: BLE001 — any failure to load is the user's folder: one line naming it
            raise ValueError(f"config rewards.models.{name}: cannot load a {mcfg.kind} ({self.auto_class}) from "
                             f"path={mcfg.path!r}: {_first_line(e)}") from None
        self.model = model.to(self.device).eval().requires_grad_(False)
        tok = self.tokenizer
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if tok.pad_token_id is None:
            raise ValueError(f"config rewards.models.{name}: the tokenizer of {mcfg.path!r} has neither a pad nor an eos token")
        if getattr(self.model.config, "pad_token_id", None) is None:  # the classifier finds the last token by it
            self.model.config.pad_token_id = tok.pad_token_id
        ctx = getattr(self.model.config, "max_position_embeddings", None) or 4096
        self.max_length = min(mcfg.max_length or ctx, ctx)
        self.chat = bool(getattr(tok, "chat_template", None))
        self.calls = self.items = self.unparsable = 0
        self.raw_mean = 0.0  # mean score of the last call before normalisation

    def _encode(self, texts: List[str]):
        tok = self.tokenizer
        tok.padding_side, tok.truncation_side = self.padding_side, "left"
        enc = tok(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt",
                  add_special_tokens=not self.chat)
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def _normalize(self, scores: List[Optional[float]], group_size: int) -> List[Optional[float]]:
        ok = [v for v in scores if v is not None]
        self.raw_mean = sum(ok) / len(ok) if ok else 0.0
        return group_normalize(scores, group_size) if self.cfg.normalize == "group" else scores

    def metrics(self) -> Dict[str, float]:
        """Counters of the last call: items scored and those without a parsable score."""
        return {f"reward/{self.name}/scored": float(self.items), f"reward/{self.name}/unparsable": float(self.unparsable),
                f"reward/{self.name}/raw_mean": self.raw_mean}


class RewardModelReward(_ModelReward):
    """`kind: classifier`: one scalar per (prompt, completion) from a sequence-classification head."""

    auto_class = "AutoModelForSequenceClassification"
    padding_side = "right"

    def __init__(self, name: str, mcfg):
        super().__init__(name, mcfg)
        n = int(getattr(self.model.config, "num_labels", 1))
        if n != 1:
            raise ValueError(f"config rewards.models.{name}: {mcfg.path!r} has a {n}-label head; a reward model has "
                             "one logit (num_labels=1)")

    def texts(self, inputs) -> List[str]:
        if not self.chat:
            return [getattr(p, "prompt", "") + c for p, c in zip(inputs.problems, inputs.completions)]
        return [self.tokenizer.apply_chat_template(_user_turns(p) + [{"role": "assistant", "content": c}], tokenize=False)
                for p, c in zip(inputs.problems, inputs.completions)]

    def raw_scores(self, texts: List[str]) -> List[float]:
        import torch

        out: List[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.cfg.batch_size):
                logits = self.model(**self._encode(texts[i:i + self.cfg.batch_size])).logits
                out.extend(logits.float().reshape(-1).tolist())
        if len(out) != len(texts):
            raise ValueError(f"reward model {self.name!r} returned {len(out)} scores for {len(texts)} completions")
        return out

    def __call__(self, inputs) -> List[Optional[float]]:
        scores = self.raw_scores(self.texts(inputs))
        self.calls, self.items, self.unparsable = self.calls + 1, len(scores), 0
        return self._normalize(scores, inputs.group_size)


class JudgeReward(_ModelReward):
    """`kind: judge`: a causal LM asked the rubric; its score from the label tokens' probabilities."""

    def __init__(self, name: str, mcfg):
        super().__init__(name, mcfg)
        where = f"config rewards.models.{name}"
        try:
            self.render("", "", "")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{where}.rubric: unknown placeholder or stray brace ({_first_line(e)}); "
                             f"expected {{prompt}} {{completion}} {{answer}} (double a literal brace: {{{{ }}}})") from None
        if mcfg.values:
            self.values = [float(v) for v in mcfg.values]
        else:
            try:
                self.values = [float(x) for x in mcfg.labels]
            except ValueError:
                raise ValueError(f"{where}.values: expected one value per label when the labels {mcfg.labels} are "
                                 "not numbers") from None
        self.label_ids = []
        for lab in (mcfg.labels if mcfg.score == "logprobs" else ()):  # generate: labels are words of the text
            ids = self.tokenizer.encode(lab, add_special_tokens=False)
            if len(ids) != 1 or ids[0] == getattr(self.tokenizer, "unk_token_id", None):
                raise ValueError(f"{where}.labels: {lab!r} is {len(ids)} tokens {ids} of the judge's vocabulary "
                                 f"({mcfg.path!r}); each label must be exactly one known token")
            self.label_ids.append(ids[0])
        self.midpoint = (min(self.values) + max(self.values)) / 2

    def render(self, prompt: str, completion: str, answer: str) -> str:
        text = self.cfg.rubric.format(prompt=prompt, completion=completion, answer=answer)
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    def label_probs(self, texts: List[str]):
        """[n, labels] probabilities of the label tokens at the position after each text."""
        import torch

        rows = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.cfg.batch_size):
                enc = self._encode(texts[i:i + self.cfg.batch_size])
                # left padding: positions count real tokens only, as an unpadded forward would
                pos = (enc["attention_mask"].long().cumsum(-1) - 1).clamp(min=0)
                try:  # only the last position's logits: [n, V], not [n, L, V]
                    out = self.model(**enc, position_ids=pos, logits_to_keep=1)
                except TypeError:  # a model class without logits_to_keep
                    out = self.model(**enc, position_ids=pos)
                logits = out.logits[:, -1, :].float()
                rows.append(torch.softmax(logits, dim=-1)[:, self.label_ids].cpu())
        return torch.cat(rows) if rows else torch.zeros(0, len(self.label_ids))

    def parse(self, text: str) -> Optional[float]:
        """`score: generate`: the value of the first label found as a word, else the first number."""
        best = None
        for lab, v in zip(self.cfg.labels, self.values):
            m = re.search(rf"(?<!\w){re.escape(lab)}(?!\w)", text)
            if m and (best is None or m.start() < best[0]):
                best = (m.start(), v)
        if best is not None:
            return best[1]
        m = _NUMBER.search(text)
        return float(m.group()) if m else None

    def generate(self, texts: List[str]) -> List[str]:
        import torch

        out: List[str] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.cfg.batch_size):
                enc = self._encode(texts[i:i + self.cfg.batch_size])
                ids = self.model.generate(**enc, max_new_tokens=self.cfg.max_new_tokens, do_sample=False,
                                          pad_token_id=self.tokenizer.pad_token_id)
                out.extend(self.tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
        return out

    def score_texts(self, texts: List[str]) -> List[Optional[float]]:
        """The judge's score of each rendered rubric; None where it gave no parsable score."""
        if self.cfg.score == "generate":
            scores = [self.parse(t) for t in self.generate(texts)]
        else:
            probs = self.label_probs(texts)
            mass = probs.sum(-1)
            weighted = (probs.double() * probs.new_tensor(self.values).double()).sum(-1)
            scores = [float(w / m) if m >= self.cfg.min_mass and m > 0 else None
                      for w, m in zip(weighted.tolist(), mass.tolist())]
        if len(scores) != len(texts):
            raise ValueError(f"judge {self.name!r} returned {len(scores)} scores for {len(texts)} texts")
        bad = sum(s is None for s in scores)
        self.calls, self.items, self.unparsable = self.calls + 1, len(scores), bad
        if bad:  # every call: the run log (fastgrpo.logs.console routes this logger to <run>/log.txt)
            logging.getLogger("fastgrpo.reward_output").info(
                "judge %r: no parsable score for %d of %d items (scored rewards.error_score)", self.name, bad, len(scores))
        if 2 * bad > len(scores) and not getattr(self, "_said_unparsable", False):
            self._said_unparsable = True  # the console once: a judge that mostly does not answer is misconfigured
            logger.warning("judge %r: %d of %d answers had no parsable score (scored rewards.error_score, counted in "
                           "reward/%s/unparsable; said once) — check rewards.models.%s: its rubric should ask for one "
                           "of the labels %s%s", self.name, bad, len(scores), self.name, self.name, list(self.cfg.labels),
                           "" if self.cfg.score == "generate" else f", min_mass={self.cfg.min_mass}")
        return scores

    def __call__(self, inputs) -> List[Optional[float]]:
        texts = [self.render(getattr(p, "prompt", ""), c, getattr(p, "answer", "") or "")
                 for p, c in zip(inputs.problems, inputs.completions)]
        return self._normalize(self.score_texts(texts), inputs.group_size)


class JudgedAccuracy:
    """Math accuracy (`fastgrpo.rewards.math.math_reward` with the task's extractor) that asks
    `judge` about the completions whose extracted answer did not parse; rows without a
    reference answer score None."""

    takes_inputs = True

    def __init__(self, judge: JudgeReward, extract=None):
        self.judge, self.extract = judge, extract
        self.asked = self.asked_total = 0

    def __call__(self, inputs) -> List[Optional[float]]:
        from fastgrpo.rewards.math import math_reward

        keep = [i for i, a in enumerate(inputs.answers) if str(a).strip()]
        prompts = [inputs.prompts[i] for i in keep]
        self.asked = 0

        def ask(idx: List[int], preds: List[str], golds: List[str]) -> List[Optional[float]]:
            self.asked += len(idx)
            texts = [self.judge.render(prompts[i], p, g) for i, p, g in zip(idx, preds, golds)]
            return [None if s is None else float(s >= self.judge.midpoint) for s in self.judge.score_texts(texts)]

        sub = math_reward([inputs.completions[i] for i in keep], [inputs.answers[i] for i in keep],
                          extract=self.extract, judge=ask) if keep else []
        out: List[Optional[float]] = [None] * len(inputs)
        for i, s in zip(keep, sub):
            out[i] = s
        self.asked_total += self.asked
        return out

    def metrics(self) -> Dict[str, float]:
        return {"reward/accuracy/judge_asked": float(self.asked), "reward/accuracy/judge_asked_total": float(self.asked_total)}


def load_model_reward(name: str, mcfg):
    """The reward of `rewards.models.<name>`, loaded once per process for the same config."""
    key = (name, repr(sorted(asdict(mcfg).items())))
    if key not in _LOADED:
        _LOADED[key] = (JudgeReward if mcfg.kind == "judge" else RewardModelReward)(name, mcfg)
    return _LOADED[key]


def release_models() -> None:
    """Drop every loaded reward model (their memory returns once nothing else holds them)."""
    _LOADED.clear()
