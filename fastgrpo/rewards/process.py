"""Process rewards: split a completion into steps, score every step, then use the step scores as
an outcome reward (one number per completion) or as dense per-token advantages.

Follows the process-supervision line of Lightman et al. 2023 ("Let's Verify Step by Step": a
process reward model scores each step; a solution's score is the minimum or the product of its
step scores), Math-Shepherd (Wang et al. 2024: step labels from a scorer instead of people) and
DeepSeekMath's GRPO with process supervision (Shao et al. 2024, §4.1.3: step rewards normalised
over all steps of a group's completions, each token credited from the steps it belongs to).

Two uses, both configured under `rewards.process` (fastgrpo.config.ProcessConfig):
  outcome  the reward `process` in `rewards.functions` = min | product | mean of the step scores
           (the three reductions of the RLVR chapter: 1, 1, 0 → 0.0, 0.0, 0.67)
  dense    `dense_weight` = w > 0: each token t of step k gets A_t = A_outcome + w·Â_k, Â_k the
           step's score normalised over the group (fastgrpo.advantages.step_advantages); the
           packed loss already takes per-token advantages (fastgrpo.packing.layout)

Steps: the completion text cut by `delimiter` (the pieces between delimiters; blank pieces are no
step) or, when `regex` is set, one step per match. A step owns its characters and the gap up to
the next step (a delimiter belongs to the step it closes); text before the first step and after
the last one belongs to no step, and its tokens get only the outcome advantage. A token belongs
to the step holding its first character; a token with no text (eos) belongs to the step of the
character before it.

Scorer (`scorer`): a user function `fn(prompt: str, steps: list[str], answer: str) ->
list[float]` (one score per step, finite; as `module:function` or `file.py:function`) or the
built-in `arithmetic` (the demo task: a think step is right when it restates the prompt's two
operands, an answer step when it holds their sum). A scorer that raises, returns the wrong
number of scores or one that is not a real number (fastgrpo.rewards.faults), and a completion
with no steps are reported (the trainer's one `reward error` line per step, naming the first
prompt id and the count) and scored `rewards.error_score` as the outcome reward; in dense mode
such a completion gets no step advantage. A user scorer runs in the user-reward worker under
`rewards.timeout` (fastgrpo/rewards/worker.py), the batch's completions in one round trip. Departures: DeepSeekMath credits a
token with the sum of the normalised scores of its step and every later one (`dense_credit:
to_go`); the default (`step`) gives a token its own step's score only, which keeps a correct
early step positive after a wrong later one.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from fastgrpo.rewards.inputs import RewardInputs, import_reward

REDUCTIONS = ("min", "product", "mean")
CREDITS = ("step", "to_go")

Span = Tuple[int, int]


# ---------------------------------------------------------------------------------------------
# steps of a text, and the steps of its tokens
# ---------------------------------------------------------------------------------------------

class StepSplitter:
    """Character spans of the steps of a text: the non-blank pieces between `delimiter`s, or
    one step per non-empty match of `regex` when it is given."""

    def __init__(self, delimiter: str = "\n", regex: str = ""):
        if not regex and not delimiter:
            raise ValueError("config rewards.process.delimiter='': expected a non-empty delimiter or a rewards.process.regex")
        try:
            self.pattern = re.compile(regex, re.DOTALL) if regex else None
        except re.error as e:
            raise ValueError(f"config rewards.process.regex={regex!r}: expected a valid regular expression ({e})") from None
        self.delimiter = delimiter

    def spans(self, text: str) -> List[Span]:
        if self.pattern is not None:
            return [m.span() for m in self.pattern.finditer(text) if m.end() > m.start()]
        out, start = [], 0
        for piece in text.split(self.delimiter):
            lead = len(piece) - len(piece.lstrip())
            body = piece.strip()
            if body:
                out.append((start + lead, start + lead + len(body)))
            start += len(piece) + len(self.delimiter)
        return out

    def split(self, text: str) -> List[str]:
        return [text[a:b] for a, b in self.spans(text)]


def token_lengths(tokenizer, ids: Sequence[int], text: str, cache: Optional[Dict[int, str]] = None) -> List[int]:
    """Characters of `text` (= the tokenizer's decode of `ids`, special tokens skipped) that each
    completion token stands for: each token's own decode when those join to `text` (character and
    most BPE tokenizers); else what the token adds to the decode of the six tokens before it (the
    incremental detokenisation of vLLM / TGI: SentencePiece's leading spaces, bytes of one
    character split over tokens). `cache`: token id → its decode, kept across calls."""
    cache = {} if cache is None else cache
    pieces = []
    for i in ids:
        piece = cache.get(i)
        if piece is None:
            piece = cache[i] = tokenizer.decode([int(i)], skip_special_tokens=True)
        pieces.append(piece)
    if "".join(pieces) == text:
        return [len(p) for p in pieces]
    lens = []
    for k in range(len(ids)):
        window = [int(x) for x in ids[max(0, k - 6):k + 1]]
        lens.append(max(0, len(tokenizer.decode(window, skip_special_tokens=True))
                        - len(tokenizer.decode(window[:-1], skip_special_tokens=True))))
    return lens


def token_offsets(tokenizer, ids: Sequence[int], text: str, cache: Optional[Dict[int, str]] = None) -> np.ndarray:
    """[C, 2] character (start, end) of each completion token in `text` (`token_lengths`, clamped
    to the text)."""
    lens = np.asarray(token_lengths(tokenizer, ids, text, cache), dtype=np.int64)
    ends = np.minimum(np.cumsum(lens), len(text))
    starts = np.concatenate([[0], ends[:-1]]) if len(ends) else ends
    return np.stack([starts, ends], axis=1).astype(np.int64) if len(ends) else np.zeros((0, 2), dtype=np.int64)


def token_steps(spans: Sequence[Span], offsets: np.ndarray) -> np.ndarray:
    """[C] int64: the step of each token (−1 = none), by the ownership rule of the module
    docstring: step k owns [start_k, start_{k+1}), the last step [start_K, end_K)."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not len(spans) or not len(offsets):
        return np.full(len(offsets), -1, dtype=np.int64)
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    last_end = int(spans[-1][1])
    # a token with no text stands for the character before it (eos closes the last step)
    pos = np.where(offsets[:, 1] > offsets[:, 0], offsets[:, 0], offsets[:, 0] - 1)
    k = np.searchsorted(starts, pos, side="right") - 1
    k[(pos < 0) | ((k == len(spans) - 1) & (pos >= last_end))] = -1
    return k


def batch_token_values(spans: Sequence[Sequence[Span]], values: Sequence[np.ndarray],
                       lengths: Sequence[Sequence[int]], text_lens: Sequence[int]) -> List[np.ndarray]:
    """For every completion j, `values[j]` at each token's step (`token_steps` of its offsets,
    0 where a token has no step), from its tokens' `token_lengths` and its text's length: one
    cumsum and one searchsorted over the whole batch instead of a dozen numpy calls per
    completion (every completion has at least one step)."""
    if not len(spans):
        return []
    n_tok = np.array([len(x) for x in lengths], dtype=np.int64)
    n_step = np.array([len(x) for x in spans], dtype=np.int64)
    lens = np.fromiter((v for x in lengths for v in x), dtype=np.int64, count=int(n_tok.sum()))
    comp_of_tok = np.repeat(np.arange(len(spans)), n_tok)
    comp_of_step = np.repeat(np.arange(len(spans)), n_step)
    cum = np.cumsum(lens)
    first = np.cumsum(n_tok) - n_tok  # each completion's first token
    local = cum - np.repeat(cum[first[n_tok > 0]] - lens[first[n_tok > 0]], n_tok[n_tok > 0])  # cumsum per completion
    text_len = np.repeat(np.asarray(text_lens, dtype=np.int64), n_tok)
    starts, ends = np.minimum(local - lens, text_len), np.minimum(local, text_len)  # clamped to the text
    span = np.array([ab for x in spans for ab in x], dtype=np.int64).reshape(-1, 2)
    # completion j's characters at j·stride + position: one sorted key space for the whole batch
    stride = int(max(int(text_len.max(initial=0)), int(span[:, 1].max(initial=0)))) + 2
    pos = np.where(ends > starts, starts, starts - 1)  # a token with no text: the character before it
    k = np.searchsorted(comp_of_step * stride + span[:, 0], comp_of_tok * stride + pos, side="right") - 1
    kk = np.maximum(k, 0)
    last = np.cumsum(n_step) - 1
    ok = (k >= 0) & (pos >= 0) & (comp_of_step[kk] == comp_of_tok)
    ok &= ~((kk == last[comp_of_tok]) & (pos >= span[kk, 1]))
    vals = np.concatenate([np.asarray(v, dtype=np.float64) for v in values])
    return np.split(np.where(ok, vals[kk], 0.0), np.cumsum(n_tok)[:-1])


# ---------------------------------------------------------------------------------------------
# scorers and reductions
# ---------------------------------------------------------------------------------------------

_TAG = re.compile(r"^\s*<(think|answer)>(.*?)</\1>\s*$", re.DOTALL)
_OPERANDS = re.compile(r"^\s*(-?\d+)\s*\+\s*(-?\d+)\s*$")


def arithmetic_steps(prompt: str, steps: Sequence[str], answer: str) -> List[float]:
    """The demo task's step scorer (fastgrpo/tasks/arithmetic.py, `"12+7="` → `<think>7+12</think>
    <answer>19</answer>`; split with regex `<think>.*?</think>|<answer>.*?</answer>`): a think step
    scores 1 when it restates the prompt's two operands (either order), an answer step when it
    holds their sum; anything else scores 0."""
    ops = _OPERANDS.match(prompt.rstrip().rstrip("="))
    want = sorted(int(x) for x in ops.groups()) if ops else None
    out = []
    for s in steps:
        m = _TAG.match(s)
        ok = False
        if m and m.group(1) == "think":
            got = _OPERANDS.match(m.group(2))
            ok = got is not None and want is not None and sorted(int(x) for x in got.groups()) == want
        elif m:
            body = m.group(2).strip()
            ok = re.fullmatch(r"-?\d+", body) is not None and re.fullmatch(r"-?\d+", str(answer).strip()) is not None \
                and int(body) == int(str(answer).strip())
        out.append(1.0 if ok else 0.0)
    return out


SCORERS: Dict[str, Callable] = {"arithmetic": arithmetic_steps}


def reduce_steps(scores: Sequence[float], reduction: str) -> float:
    """One outcome reward from step scores: min (Lightman et al.: a solution is as good as its
    worst step), product (the probability every step is right), mean (partial credit)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r}: expected one of {list(REDUCTIONS)}")
    if not len(scores):
        raise ValueError("scores: expected at least one step score")
    if reduction == "min":
        return float(min(scores))
    if reduction == "product":
        return float(math.prod(scores))
    return float(sum(scores) / len(scores))


@dataclass
class StepResult:
    """One completion's steps: character spans, the scorer's scores (None when it failed), why."""

    spans: List[Span]
    scores: Optional[List[float]]
    error: Optional[str] = None


# ---------------------------------------------------------------------------------------------
# the reward of a run
# ---------------------------------------------------------------------------------------------

class ProcessReward:
    """The `rewards.process` of a run (built by `build_process`, held by `Rewards.process`).
    Called as the `@inputs_reward` `process`, it scores a batch's steps, keeps them for the dense
    advantages of the same batch (`results_for`) and returns each completion's reduction, None
    (→ rewards.error_score) where scoring failed, with the failure kept for `drain_errors`."""

    takes_inputs = True

    def __init__(self, scorer: Callable, splitter: StepSplitter, reduction: str = "min", dense_weight: float = 0.0,
                 credit: str = "step", name: str = "process", runner=None):
        if reduction not in REDUCTIONS:
            raise ValueError(f"config rewards.process.reduction={reduction!r}: expected one of {list(REDUCTIONS)}")
        if credit not in CREDITS:
            raise ValueError(f"config rewards.process.dense_credit={credit!r}: expected one of {list(CREDITS)}")
        self.scorer, self.splitter, self.reduction = scorer, splitter, reduction
        self.dense_weight, self.credit, self.name = float(dense_weight), credit, name
        self.runner = runner  # a user scorer in the user-reward worker (rewards.timeout): WorkerFunction, or None
        # `process` is among rewards.functions (set by build_rewards): a completion without steps then
        # scores rewards.error_score and is reported; in dense mode alone it only gets no step advantage
        self.outcome = False
        self._stats: Dict[str, float] = {}
        self._last: Optional[Tuple[List[str], List[StepResult]]] = None
        self._errors: List[str] = []
        self._item_errors: Dict[int, str] = {}  # the last call's failed completions (drain_item_errors)
        self._pieces: Dict[int, str] = {}  # token id → its decode (token_offsets' fast path)

    @property
    def dense(self) -> bool:
        return self.dense_weight > 0

    @staticmethod
    def _check(spans: List[Span], got) -> StepResult:
        """The step result of a scorer's answer `got` for `spans`."""
        from fastgrpo.rewards.faults import check_score

        try:
            got = list(got)
        except TypeError:
            return StepResult(spans, None, f"the scorer returned a {type(got).__name__}, expected a list of scores")
        if len(got) != len(spans):
            return StepResult(spans, None, f"the scorer returned {len(got)} scores for {len(spans)} steps")
        vals = []
        for v in got:
            f, why = check_score(v)
            if why is not None or f is None:
                return StepResult(spans, None, f"the scorer returned {why or 'None'} among its step scores")
            vals.append(f)
        return StepResult(spans, vals)

    def score_one(self, prompt: str, text: str, answer: str) -> StepResult:
        spans = self.splitter.spans(text)
        if not spans:
            return StepResult(spans, None, "the step splitter found no steps in the completion")
        try:
            got = self.scorer(prompt, [text[a:b] for a, b in spans], answer)
        except Exception as e:  # noqa: BLE001 — a user scorer's failure is reported, never fatal
            return StepResult(spans, None, f"the scorer raised {type(e).__name__}: {e}")
        return self._check(spans, got)

    def _score_in_worker(self, items: List[Tuple[str, str, str]]) -> List[StepResult]:
        from fastgrpo.rewards.worker import describe

        spans = [self.splitter.spans(text) for _, text, _ in items]
        todo = [k for k, sp in enumerate(spans) if sp]
        out = [StepResult(sp, None, "the step splitter found no steps in the completion") for sp in spans]
        try:
            got = self.runner.each([(items[k][0], [items[k][1][a:b] for a, b in spans[k]], items[k][2]) for k in todo])
        except Exception as e:  # noqa: BLE001 — a timeout or a crashed worker fails the whole call
            for k in todo:
                out[k] = StepResult(spans[k], None, f"the scorer {describe(e)}")
            return out
        for k, (ok, value) in zip(todo, got):
            out[k] = self._check(spans[k], value) if ok else StepResult(spans[k], None, f"the scorer raised {value}")
        return out

    def score(self, inputs: RewardInputs) -> List[StepResult]:
        """Step results of every completion of `inputs` (kept for `results_for`); failures are
        kept for `drain_item_errors` (the scoring path reports them) and queued for
        `drain_errors`, one line per call naming the first prompt id and the count."""
        G = max(1, inputs.group_size)
        items = [(getattr(p, "prompt", ""), text, str(getattr(p, "answer", "")))
                 for text, p in zip(inputs.completions, inputs.problems)]
        if self.runner is not None:
            out = self._score_in_worker(items)
        else:
            out = [self.score_one(*it) for it in items]
        no_steps = sum(1 for r in out if not r.spans)
        self._item_errors = {j: r.error for j, r in enumerate(out)
                             if r.error is not None and (self.outcome or r.spans)}
        scored = [r for r in out if r.scores is not None]
        n = max(1, len(out))
        self._stats = {"process/steps_mean": sum(len(r.spans) for r in out) / n, "process/no_steps": no_steps / n,
                       "process/failed": sum(1 for r in out if r.spans and r.scores is None) / n}
        if scored:
            self._stats["process/step_score_mean"] = float(np.mean([v for r in scored for v in r.scores]))
        self._errors = []
        if self._item_errors:
            j = min(self._item_errors)
            prob = inputs.problems[j]
            key = getattr(prob, "key", "") or getattr(prob, "id", j // G)
            n = len(self._item_errors)
            self._errors.append(f"reward {self.name!r} on prompt id {key}: {self._item_errors[j]} (completion {j % G}); "
                                f"scored rewards.error_score — {n} of {len(out)} completions failed this step")
        self._last = (list(inputs.completions), out)
        return out

    def metrics(self) -> Dict[str, float]:
        """The last call's steps: mean steps per completion, the mean step score, and the
        fractions of completions with no step and whose scoring failed (metrics.jsonl)."""
        return dict(self._stats)

    def drain_item_errors(self) -> Dict[int, str]:
        """{completion index: why} of the last call (then forgotten, with its `drain_errors` line)."""
        out, self._item_errors, self._errors = self._item_errors, {}, []
        return out

    def __call__(self, inputs: RewardInputs) -> List[Optional[float]]:
        return [None if r.scores is None else reduce_steps(r.scores, self.reduction) for r in self.score(inputs)]

    def results_for(self, problems: Sequence, groups: Sequence) -> List[StepResult]:
        """The step results of this rollout batch (completion-major): those of the `process`
        reward's call on it when there was one, else scored now."""
        comps = [c for g in groups for c in g]
        texts = [c.text for c in comps]
        if self._last is not None and self._last[0] == texts:
            return self._last[1]
        G = len(groups[0]) if groups else 1
        return self.score(RewardInputs(completions=texts, problems=[p for p in problems for _ in range(G)],
                                       group_size=G))

    def drain_errors(self) -> List[str]:
        out, self._errors = self._errors, []
        return out

    def attach_dense(self, problems: Sequence, groups: Sequence, tokenizer) -> np.ndarray:
        """Dense mode: set `c.step_advantages` (float32 [C_c] = w·Â of each token's step, 0 off
        the steps) on every completion of the batch; returns [B] bool, the groups whose step
        scores vary (they carry a gradient even when every outcome reward is equal)."""
        from fastgrpo.advantages import step_advantages

        results = self.results_for(problems, groups)
        G = len(groups[0]) if groups else 1
        adv = step_advantages([r.scores for r in results], G, credit=self.credit)
        comps = [c for g in groups for c in g]
        scored = [k for k, a in enumerate(adv) if a is not None]
        per_tok = batch_token_values([results[k].spans for k in scored], [adv[k] for k in scored],
                                     [token_lengths(tokenizer, comps[k].token_ids, comps[k].text, self._pieces)
                                      for k in scored], [len(comps[k].text) for k in scored])
        for c in comps:
            c.step_advantages = np.zeros(len(c.token_ids), dtype=np.float32)
        for k, v in zip(scored, per_tok):
            comps[k].step_advantages = (self.dense_weight * v).astype(np.float32)
        return _groups_varying(adv, G, len(groups))


def attach_turn_advantages(groups: Sequence, weight: float = 1.0, credit: str = "to_go") -> np.ndarray:
    """rollout.turn_rewards=dense: an environment's per-turn rewards (`Ledger.turn_rewards`) as
    step scores of the existing per-token path. Each episode's turn rewards are normalised over
    every turn reward of its group (`step_advantages`, credit "to_go": a turn gets its own
    advantage plus every later turn's) and spread over the sampled ids of their turns
    (`Completion.turn_slots`, set by the episode runner; a turn without a reward takes the next
    rewarded turn's, ids after the last reward and every non-sampled id 0), times `weight`, added
    to `step_advantages` (a process reward's, when both are on). The outcome advantage is
    untouched. Returns [B] bool: the groups whose turn rewards vary."""
    from fastgrpo.advantages import step_advantages

    G = len(groups[0]) if groups else 1
    comps = [c for g in groups for c in g]
    scores = []
    for c in comps:
        led = getattr(c, "episode", None)
        scores.append([r for _, r in led.turn_rewards] if led is not None and led.turn_rewards else None)
    adv = step_advantages(scores, G, credit=credit)
    for c, a in zip(comps, adv):
        for part in [c] + list(getattr(c, "forks", ()) or ()):
            slots = getattr(part, "turn_slots", None)
            if a is None or slots is None:
                continue
            dense = np.where(slots >= 0, a[np.maximum(slots, 0)], 0.0).astype(np.float32) * np.float32(weight)
            prev = getattr(part, "step_advantages", None)
            part.step_advantages = dense if prev is None else prev + dense
    return _groups_varying(adv, G, len(groups))


def _groups_varying(adv: list, G: int, B: int) -> np.ndarray:
    """[B] bool: the groups (G consecutive completions each) with a non-zero step advantage."""
    return np.array([any(a is not None and bool(np.any(a != 0)) for a in adv[i * G:(i + 1) * G]) for i in range(B)],
                    dtype=bool)


def token_advantages(outcome: float, completion):
    """What the packer gets for one completion: its outcome advantage (a float), plus its dense
    step advantages when `ProcessReward.attach_dense` set them."""
    step = getattr(completion, "step_advantages", None)
    return outcome if step is None else step + np.float32(outcome)


def build_process(pcfg, timeout: float = 0.0, base_dir=None) -> Optional[ProcessReward]:
    """The ProcessReward of a `ProcessConfig`, or None when `scorer` is empty. A scorer path that
    does not import, an unknown built-in, a bad regex or reduction raise ValueError naming the
    field (at load, before any model starts). `timeout` > 0 (rewards.timeout): a user scorer runs
    in the user-reward worker, one round trip per batch with that many seconds."""
    if not pcfg.scorer:
        return None
    runner = None
    if ":" in pcfg.scorer:
        from fastgrpo.rewards.worker import WorkerFunction

        fn = import_reward(pcfg.scorer, field="rewards.process.scorer", base_dir=base_dir)
        runner = WorkerFunction(pcfg.scorer, fn, timeout, "process") if timeout > 0 else None
    elif pcfg.scorer in SCORERS:
        fn = SCORERS[pcfg.scorer]
    else:
        raise ValueError(f"config rewards.process.scorer={pcfg.scorer!r}: expected a built-in scorer among "
                         f"{sorted(SCORERS)} or a user function as 'module:function' / 'file.py:function'")
    return ProcessReward(fn, StepSplitter(pcfg.delimiter, pcfg.regex), pcfg.reduction, pcfg.dense_weight,
                         pcfg.dense_credit, runner=runner)

