"""Thinking-mode fusion (Qwen3 technical report, §4.3): after RL, SFT on a mix of thinking and
non-thinking examples so that one set of weights serves both modes.

The stage (`fusion_stage`, `fastgrpo fuse`, or `fusion.enabled` after GRPO in `fastgrpo train`):

1. `collect_traces`: sample `fusion.group_size` completions per train prompt with the RL model
   (the run's rollout engine, the prompts as RL saw them) and keep the verified ones: accuracy
   reward >= `fusion.min_accuracy` (1 = only reward-1 traces), format reward 1 when the run has
   one, not cut by the length cap, exactly one `rollout.think_end`; duplicates (same prompt,
   same text) are dropped.
2. `build_mix`: thinking examples (prompt [+ `fusion.think_flag`] → the model's own trace) and
   non-thinking examples (prompt + `fusion.no_think_flag` → `fusion.no_think_prefix` + the
   trace's answer, e.g. `<think></think><answer>19</answer>` as Qwen3's empty think block), in
   the ratio `fusion.think_ratio`. Flags go at the end of the user's message: before the chat
   template's end of turn when the prompt went through one (found by rendering a probe
   message), else at the end of the prompt text. When the tokenizer's template reads
   `enable_thinking` (Qwen3's hard switch; `fusion.template_switch`), the mode's generation
   prompt is the template's own (with enable_thinking=False it already holds the empty think
   block, so the non-thinking target is the answer alone).
3. SFT on the mix through the cold start's packed path (`fastgrpo.trainer.sft.run_sft`), the
   fused model saved atomically to `<run>/fusion/model`.
4. The thinking-budget sweep before and after (`fastgrpo.recipes.budget_sweep`).

Departures from Qwen3: the thinking traces are the RL model's own verified rollouts (Qwen3 uses
rejection-sampled outputs of its stage-2 model on the stage-1 queries), the
non-thinking answers are those traces' answers with the reasoning cut away (Qwen3 draws them
from a separate, diverse instruction set), and `fusion.interrupted_fraction` (0 = off, Qwen3's
recipe) can add thinking examples whose reasoning is cut after a random number of tokens and
closed by the interrupt string, for a model too small to learn on its own what to do after an
interrupt (on the demo the Qwen3 recipe alone leaves a cliff: see the README's figures).
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fastgrpo.tasks.base import Problem
from fastgrpo.recipes.budget_sweep import score

Log = Callable[[str], None]
_PROBE = "\x1ffastgrpo-probe\x1f"


@dataclass(frozen=True)
class Trace:
    problem: object  # the task's problem (its prompt as RL saw it, its reference answer)
    text: str  # the verified completion: reasoning, think_end, answer
    think_tokens: int  # tokens up to and including think_end (the trace's thinking length)


class ModeSwitch:
    """The prompt of a problem in thinking / non-thinking mode, and the non-thinking target's
    prefix (see the module docstring for where the flags go)."""

    def __init__(self, tokenizer, fcfg, templated: bool, task_enable_thinking: Optional[bool] = None,
                 think_end: str = "</think>"):
        self.think_flag, self.no_think_flag = fcfg.think_flag, fcfg.no_think_flag
        template = getattr(tokenizer, "chat_template", None) if templated else None
        reads_switch = isinstance(template, str) and "enable_thinking" in template
        if fcfg.template_switch == "always" and not reads_switch:
            why = "the task's prompts do not go through a chat template" if not templated else \
                "the tokenizer's chat template does not read enable_thinking"
            raise ValueError(f"config fusion.template_switch=always: {why}; set fusion.template_switch=auto or never")
        self.uses_template_switch = reads_switch and fcfg.template_switch != "never"
        self._tail = self._tails = None
        if template:
            self._tail = _tail(tokenizer, task_enable_thinking)
            if self.uses_template_switch:
                self._tails = {True: _tail(tokenizer, True), False: _tail(tokenizer, False)}
        # the template's no-think generation prompt already closes the (empty) reasoning
        closes = self.uses_template_switch and think_end in self._tails[False] and think_end not in self._tails[True]
        self.no_think_prefix = "" if closes else fcfg.no_think_prefix
        if not self.uses_template_switch and self.think_flag == self.no_think_flag:
            raise ValueError(f"config fusion.no_think_flag={self.no_think_flag!r}: the same as fusion.think_flag and "
                             "no chat-template switch (enable_thinking): the two modes would share one prompt; set "
                             "fusion.no_think_flag (e.g. ' /no_think')")

    def prompt(self, prompt: str, thinking: bool) -> str:
        flag = self.think_flag if thinking else self.no_think_flag
        if self._tail and prompt.endswith(self._tail):
            tail = self._tails[thinking] if self._tails else self._tail
            return prompt[: len(prompt) - len(self._tail)] + flag + tail
        return prompt + flag


def _tail(tokenizer, enable_thinking: Optional[bool]) -> str:
    """What the chat template renders after a user message's text: its end of turn and the
    generation prompt (with `enable_thinking` when set)."""
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False,
                                         add_generation_prompt=True, **kw)
    return text.split(_PROBE, 1)[1]


def mode_switch(cfg, tokenizer, task) -> ModeSwitch:
    return ModeSwitch(tokenizer, cfg.fusion, bool(getattr(task, "chat_template_applied", False)),
                      cfg.data.enable_thinking, cfg.rollout.think_end)


def collect_traces(engine, tokenizer, problems: Sequence, reward_fns, cfg, chunk: int = 256) -> Tuple[List[Trace], Dict]:
    """The RL model's verified traces of `problems` (see the module docstring, step 1) and the
    counts behind them. Raises ValueError naming the counts and the threshold when none passes."""
    from fastgrpo.rollout.base import SamplingConfig

    f, r = cfg.fusion, cfg.rollout
    sampling = SamplingConfig(temperature=f.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop=tuple(r.stop), seed=cfg.seed + 4242)
    n = 1 if f.temperature == 0 else f.group_size  # greedy: G copies of one completion
    seen, traces = set(), []
    counts = {"rollouts": 0, "accurate": 0, "well_formed": 0, "kept": 0}
    for i in range(0, len(problems), chunk):
        part = list(problems[i:i + chunk])
        comps = [c for g in engine.generate([p.prompt for p in part], n=n, sampling=sampling) for c in g]
        probs = [p for p in part for _ in range(n)]
        acc = score(reward_fns, probs, comps, "accuracy")
        fmt = score(reward_fns, probs, comps, "format") if "format" in reward_fns else [1.0] * len(comps)
        counts["rollouts"] += len(comps)
        for p, c, a, fm in zip(probs, comps, acc, fmt):
            if a < f.min_accuracy:
                continue
            counts["accurate"] += 1
            if fm < 1.0 or c.finish_reason == "length" or c.text.count(r.think_end) != 1:
                continue
            counts["well_formed"] += 1
            if (p.id, c.text) in seen:
                continue
            seen.add((p.id, c.text))
            head = c.text[: c.text.index(r.think_end) + len(r.think_end)]
            traces.append(Trace(p, c.text, len(tokenizer(head, add_special_tokens=False)["input_ids"])))
    counts["kept"] = len(traces)
    counts["prompts"] = len(problems)
    if not traces:
        raise ValueError(f"fusion: no verified traces: {counts['accurate']} of {counts['rollouts']} rollouts of "
                         f"{len(problems)} train prompts reached fusion.min_accuracy={f.min_accuracy}, "
                         f"{counts['well_formed']} of them well formed (format reward 1, one {r.think_end!r}, not cut "
                         f"by rollout.max_new_tokens={r.max_new_tokens}); fuse an RL-trained model "
                         "(--set model.path=<run folder>) or lower fusion.min_accuracy")
    return traces, counts


def answer_part(text: str, think_end: str) -> str:
    """What a trace says after its reasoning (leading whitespace dropped: the no-think prefix
    carries the separator)."""
    return text.split(think_end, 1)[1].lstrip()


def build_mix(traces: Sequence[Trace], switch: ModeSwitch, cfg, tokenizer=None,
              rng: Optional[random.Random] = None) -> List[Dict[str, str]]:
    """The SFT mix: {prompt, completion, mode} rows, `fusion.think_ratio` of them thinking
    (mode "think"), the rest non-thinking ("no_think"), `fusion.mix_size` in all (0 = two per
    trace). Traces are drawn round-robin over a seeded shuffle, so every one is used before any
    repeats. `fusion.interrupted_fraction` of the thinking rows are cut (needs `tokenizer`)."""
    from fastgrpo.rollout.base import DEFAULT_INTERRUPT

    f, r = cfg.fusion, cfg.rollout
    if not traces:
        raise ValueError("fusion: build_mix got no traces")
    rng = rng or random.Random(cfg.seed + 77)
    total = f.mix_size or 2 * len(traces)
    n_think = int(math.floor(f.think_ratio * total + 0.5))
    order = list(traces)
    rng.shuffle(order)

    def draw(k: int) -> List[Trace]:
        return [order[j % len(order)] for j in range(k)]

    interrupt = r.interrupt or DEFAULT_INTERRUPT
    rows = []
    for t in draw(n_think):
        text = t.text
        if f.interrupted_fraction > 0 and rng.random() < f.interrupted_fraction:
            if tokenizer is None:
                raise ValueError("fusion.interrupted_fraction > 0: build_mix needs the tokenizer to cut traces")
            think = text.split(r.think_end, 1)[0]
            opener = f.think_start if f.think_start and think.startswith(f.think_start) else ""
            ids = tokenizer(think[len(opener):], add_special_tokens=False)["input_ids"]
            # the reasoning cut after 0 .. all of its tokens (the opener kept, as a budget cut keeps it)
            cut = opener + tokenizer.decode(ids[: rng.randrange(len(ids) + 1)], skip_special_tokens=False)
            text = cut + interrupt + answer_part(text, r.think_end)
        rows.append({"prompt": switch.prompt(t.problem.prompt, True), "completion": text, "mode": "think"})
    for t in draw(total - n_think):
        rows.append({"prompt": switch.prompt(t.problem.prompt, False),
                     "completion": switch.no_think_prefix + answer_part(t.text, r.think_end), "mode": "no_think"})
    rng.shuffle(rows)
    return rows


class _MixTask:
    """The mix as a task for `run_sft`: train problems that carry their completion."""

    name = "fusion-mix"
    has_completions = True

    def __init__(self, rows: Sequence[Dict[str, str]]):
        self.train = [Problem(id=i, prompt=x["prompt"], completion=x["completion"]) for i, x in enumerate(rows)]
        self.heldout: List[Problem] = []


def fusion_sft(cfg, model, tokenizer, rows, out_dir: Optional[str] = None, on_step=None) -> Dict[str, float]:
    """SFT of `model` (in place) on the mix with the cold start's packed path; the fused model
    saved atomically to `<out_dir>/fusion/model` when out_dir is given."""
    from fastgrpo.logs.metrics import MetricsLogger
    from fastgrpo.trainer.sft import run_sft

    f = cfg.fusion
    scfg = copy.deepcopy(cfg)
    scfg.sft.steps, scfg.sft.noise = f.steps, 0.0
    scfg.sft.batch_size = f.batch_size or cfg.sft.batch_size
    scfg.sft.lr = f.lr or cfg.sft.lr
    logger = MetricsLogger(os.path.join(out_dir, "fusion"), tensorboard=False) if out_dir else None

    def step(i, m):
        if logger is not None:
            logger.log(i, {k.replace("sft/", "fusion/sft_"): v for k, v in m.items()})
        if on_step is not None:
            on_step(i, m)

    try:
        last = run_sft(scfg, model, tokenizer, _MixTask(rows), out_dir=None, on_step=step)
    finally:
        if logger is not None:
            logger.close()
    if out_dir:
        from fastgrpo.runs.checkpoint import save_model_atomic

        save_model_atomic(model, tokenizer, os.path.join(out_dir, "fusion", "model"))
    return last


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def fusion_stage(cfg, model, tokenizer, task, reward_fns, engine, log: Log = print) -> Dict[str, float]:
    """Collect → mix → SFT → sweep (before and after) for a model trained by RL; writes
    `<out>/fusion/` (model/, mix.jsonl, traces.json, metrics.jsonl, budget_sweep.json / .csv)
    and `<out>/plots/budget_sweep.png`. Returns a summary of figures."""
    from fastgrpo.recipes.budget_sweep import full_budget_of, plot_sweep, run_sweep, write_sweep

    f, out = cfg.fusion, cfg.logging.out_dir
    fdir = os.path.join(out, "fusion")
    os.makedirs(fdir, exist_ok=True)
    if not task.heldout and f.budget_fractions:
        raise ValueError("fusion: the budget sweep needs a held-out split (data.eval_path, data.eval_fraction, "
                         "data.eval_split; the built-in task: data.num_heldout)")
    switch = mode_switch(cfg, tokenizer, task)
    t0 = time.perf_counter()
    pool = list(task.train)
    if f.max_prompts and f.max_prompts < len(pool):
        pool = random.Random(cfg.seed + 5).sample(pool, f.max_prompts)
    traces, counts = collect_traces(engine, tokenizer, pool, reward_fns, cfg)
    budget = full_budget_of(traces, f.full_budget)
    log(f"[fastgrpo] fusion: {counts['kept']} verified traces from {counts['rollouts']} rollouts of "
        f"{counts['prompts']} prompts ({counts['accurate']} accurate, {counts['well_formed']} well formed); "
        f"full thinking budget {budget} tokens")
    _write_json(os.path.join(fdir, "traces.json"), {**counts, "full_budget": budget,
                                                      "template_switch": switch.uses_template_switch})
    before = run_sweep(engine, task.heldout, reward_fns, switch, cfg, budget) if f.sweep_before else []
    rows = build_mix(traces, switch, cfg, tokenizer)
    with open(os.path.join(fdir, "mix.jsonl"), "w") as fh:
        for x in rows:
            fh.write(json.dumps(x) + "\n")
    n_think = sum(x["mode"] == "think" for x in rows)
    last = fusion_sft(cfg, model, tokenizer, rows, out_dir=out)
    if hasattr(engine, "update_weights") and getattr(engine, "model", None) is not model:
        engine.update_weights(model)  # an engine with weights of its own (vLLM) samples the fused model
    log(f"[fastgrpo] fusion SFT: {f.steps} steps on {len(rows)} examples ({n_think} thinking, "
        f"{len(rows) - n_think} non-thinking), loss {last.get('sft/loss', float('nan')):.3f}; "
        f"model in {os.path.join(fdir, 'model')}")
    after = run_sweep(engine, task.heldout, reward_fns, switch, cfg, budget)
    write_sweep(fdir, before, after)
    if cfg.logging.plots:
        plot_sweep(os.path.join(out, "plots", "budget_sweep.png"), before, after)
    summary = {"fusion/traces": float(counts["kept"]), "fusion/full_budget": float(budget),
               "fusion/wall_s": time.perf_counter() - t0}
    for tag, sweep in (("before", before), ("after", after)):
        for row in sweep:
            summary[f"fusion/{tag}/{row['mode']}/accuracy@{row['fraction']:g}"] = row["accuracy"]
    for row in after:
        if row["fraction"] == max(f.budget_fractions):
            log(f"[fastgrpo] after fusion, {row['mode']} mode at the full budget: accuracy {row['accuracy']:.3f}, "
                f"empty think span {row['empty_think']:.2f}, completion {row['length_mean']:.1f} tokens")
    return summary


def run_fuse(cfg, log: Log = print) -> Dict[str, float]:
    """`fastgrpo fuse`: fusion of model.path (a run folder: its latest checkpoint) in the run
    folder logging.out_dir. Every input (tokenizer, task, rewards) is checked before the model
    or the engine starts."""
    import torch

    from fastgrpo.rewards.registry import build_rewards
    from fastgrpo.rollout.base import DEFAULT_INTERRUPT
    from fastgrpo.tasks.formatting import prompt_lengths
    from fastgrpo.trainer.build import build_model, build_rollout_engine, build_task, build_tokenizer
    from fastgrpo.trainer.grpo import seed_everything

    r, f = cfg.rollout, cfg.fusion
    tok, ctx = build_tokenizer(cfg.model)
    task = build_task(cfg.data, tok, context_len=ctx, max_new_tokens=r.max_new_tokens)
    rewards = build_rewards(cfg.rewards, task, r.max_new_tokens, getattr(cfg, "config_dir", None))
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.makedirs(cfg.logging.out_dir, exist_ok=True)
    seed_everything(cfg.seed)
    model, tok = build_model(cfg.model, tokenizer=tok)
    prompts = [p.prompt for p in list(task.train) + list(task.heldout)]

    def longest():  # vLLM's context: a flagged prompt + a forced interrupt + the answer budget on top
        extra = f"{f.think_flag}{f.no_think_flag}{f.think_start}{r.interrupt or DEFAULT_INTERRUPT}"
        return max(prompt_lengths(tok, prompts)) + len(tok(extra, add_special_tokens=False)["input_ids"]) + r.answer_budget

    engine = build_rollout_engine(r, model, tok, prompt_len=longest)
    try:
        out = fusion_stage(cfg, model, tok, task, rewards, engine, log=log)
    finally:
        engine.close()
    _write_json(os.path.join(cfg.logging.out_dir, "fusion", "summary.json"), out)
    return out


def run_config_path(overrides: Sequence[str]) -> Optional[str]:
    """The config.yaml of the run folder that `--set model.path=…` names (None when it names
    none): `fastgrpo fuse` starts from the settings the RL model was trained with."""
    from fastgrpo.config import parse_override

    path = None
    for item in overrides:
        keys, value = parse_override(item)
        if keys == ["model", "path"]:
            path = value
        elif keys == ["model"] and isinstance(value, dict) and "path" in value:
            path = value["path"]
    if not isinstance(path, str):
        return None
    for d in (path, os.path.dirname(os.path.dirname(os.path.abspath(path)))):  # a run folder, or one of its checkpoints
        if os.path.isfile(os.path.join(d, "config.yaml")):
            return os.path.join(d, "config.yaml")
    return None
