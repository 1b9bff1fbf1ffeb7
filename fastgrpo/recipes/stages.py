"""The stage after RLVR: GRPO with reward models / judges on a mixed prompt set (`rm_stage`).

DeepSeek-R1 (§2.3.4), Kimi K1.5 and Qwen3 (stage 4, "general RL") follow reasoning RL with a
stage on prompts of every kind: verifiable ones keep their rule-based reward, open-ended ones
(writing, instruction following) are scored by a reward model or an LLM judge. Here the stage
continues from the RLVR stage's final checkpoint with its own prompt set (`rm_stage.prompts`:
rows with a `prompt` or `messages` column, and an `answer` where the row is verifiable), its own
rewards (`rm_stage.functions` / `weights`: any reward name, including `rewards.models` entries),
its own run folder `<out_dir>/rm_stage/` (config.yaml, metrics.jsonl, checkpoints/,
summary.json: a separate phase in the logs and in resume) and its own step count; every other
setting is the run's. The held-out set is the RLVR task's, so `eval/accuracy` before and after
the stage says whether the verifiable skill survived it.

On the stage's prompts `accuracy` is the RLVR task's verifier on rows with an answer and None
(unverifiable, counted as `rewards.error_score`, the same for the G completions of a prompt, so it
moves no advantage) on open-ended rows; with `rm_stage.route` (the default, R1's split: "rule-based
rewards for reasoning data, reward models for general data") the reward models of `rewards.models`
likewise score only the rows without an answer. Measured on the demo (RLVR 200 steps, then 40
stage steps on 64 sums + 64 open prompts, accuracy 1.0 + format 0.1 + a group-normalised tiny
marker RM 0.5): without routing the RM's z-scored noise on the sums, where accuracy is often
the same for all G, drove held-out accuracy 0.815 → 0.005 (reward hacking of a proxy, the
chapter's point); routed, 0.815 → 0.535 while the RM's raw score on the open prompts rose
−2.59 → 2.60 (a tiny model shares its weights between the kinds); routed with
`rm_stage.beta=0.1` (KL to the RLVR model), 0.815 → 0.770 with the raw score −2.59 → 2.23
(benchmarks/bench_rm_stage.py, benchmarks/results/rm_stage.json).

Resume: a run started again with the same out_dir skips the RLVR stage once the stage has a
checkpoint and resumes the stage from its latest one; the stage's model is built from the RLVR
model first (its KL reference), then the checkpoint's weights are loaded.
Departure from the papers: one prompt file holds both kinds (they mix data sources by sampler
weights); weight the kinds by how many rows of each the file holds.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from typing import Callable, Dict, List, Optional

STAGE_DIR = "rm_stage"
Log = Callable[[str], None]


def stage_dir(cfg) -> str:
    return os.path.join(cfg.logging.out_dir, STAGE_DIR)


def stage_config(cfg):
    """The stage's TrainConfig: the run's, with the stage's steps, rewards, lr and run folder."""
    from fastgrpo.config import RMStageConfig

    st = cfg.rm_stage
    s = copy.deepcopy(cfg)
    s.steps, s.sft_first = st.steps, False
    s.rewards.functions, s.rewards.weights = list(st.functions), list(st.weights)
    s.optimizer.lr = st.lr or cfg.optimizer.lr
    s.algorithm.beta = st.beta or cfg.algorithm.beta  # the reference is the stage's start: the RLVR model
    s.logging.out_dir = stage_dir(cfg)
    s.checkpoint.resume = "none" if cfg.checkpoint.resume == "none" else "auto"  # the stage's own checkpoints
    s.rm_stage = RMStageConfig()
    return s


def stage_started(cfg) -> bool:
    """True when the run has an rm_stage with a checkpoint to resume from (RLVR is then done)."""
    from fastgrpo.runs.checkpoint import list_checkpoints

    return bool(cfg.rm_stage.steps) and cfg.checkpoint.resume != "none" and bool(list_checkpoints(stage_dir(cfg)))


class MixedTask:
    """The stage's prompts (train) and the RLVR task's held-out set; see the module docstring."""

    name = "mixed"
    has_completions = False

    def __init__(self, train: List, base, models=None):
        self.train, self.heldout, self.base = train, list(getattr(base, "heldout", []) or []), base
        self.models = dict(models or {})  # rm_stage.route: the reward models scored on open-ended rows only
        self.format_tags = getattr(base, "format_tags", None)
        if hasattr(base, "extract"):  # the math extractor: rewards.accuracy_judge reads answers with it
            self.extract = base.extract

    def reward_fns(self) -> Dict[str, Callable]:
        from fastgrpo.rewards.judge import load_model_reward

        base = dict(self.base.reward_fns()) if hasattr(self.base, "reward_fns") else {}
        fns = {k: v for k, v in base.items() if k != "accuracy"}
        if "accuracy" in base:  # the RLVR task's accuracy on rows with an answer
            fns["accuracy"] = RowsReward(base["accuracy"], answered=True)
        for name, m in self.models.items():  # loaded once (load_model_reward keeps them)
            fns[name] = RowsReward(load_model_reward(name, m), answered=False)
        return fns


class RowsReward:
    """`fn` on the rows with an answer (`answered=True`) or on those without; None elsewhere (the
    same for a prompt's G completions: it moves no advantage)."""

    takes_inputs = True

    def __init__(self, fn: Callable, answered: bool):
        self.fn, self.answered = fn, answered

    def __call__(self, inputs) -> List[Optional[float]]:
        from fastgrpo.rewards.registry import call_reward

        idx = [i for i, a in enumerate(inputs.answers) if bool(str(a).strip()) == self.answered]
        out: List[Optional[float]] = [None] * len(inputs)
        if idx:
            for i, v in zip(idx, call_reward(self.fn, _select(inputs, idx))):
                out[i] = v
        return out

    def metrics(self) -> Dict[str, float]:
        return self.fn.metrics() if hasattr(self.fn, "metrics") else {}


def _select(inputs, idx: List[int]):
    """RewardInputs of the completions `idx` (whole groups: a row's G completions share its answer)."""
    from fastgrpo.rewards.registry import RewardInputs

    pick = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731
    return RewardInputs(pick(inputs.completions), pick(inputs.problems), pick(inputs.lengths), pick(inputs.truncated),
                        pick(inputs.completion_ids), inputs.group_size,
                        {k: pick(v) for k, v in inputs.scores.items()}, inputs.step)


def build_stage_task(cfg, tokenizer, base, context_len: Optional[int] = None) -> MixedTask:
    """The stage's prompts of the run config's `rm_stage.prompts`, formatted like the run's (data.chat_template,
    system_prompt, enable_thinking); an unreadable row is a ValueError naming it."""
    from fastgrpo.tasks.base import Problem
    from fastgrpo.tasks.formatting import PromptFormatter, row_turns
    from fastgrpo.tasks.loaders import load_rows

    path = cfg.rm_stage.prompts
    rows = load_rows(path, split=cfg.data.split, field="rm_stage.prompts")
    if not rows:
        raise ValueError(f"config rm_stage.prompts={path!r}: no rows")
    d = cfg.data
    fmt = PromptFormatter(tokenizer, d.chat_template, d.system_prompt, d.enable_thinking)
    taken = [p.id for p in list(getattr(base, "train", [])) + list(getattr(base, "heldout", []) or [])]
    first = max(taken, default=-1) + 1  # ids past the RLVR task's: one curriculum key per prompt
    probs = []
    for j, (row, where) in enumerate(zip(rows, rows.locations)):
        col = "prompt" if "prompt" in row else "messages" if "messages" in row else None
        if col is None:
            raise ValueError(f"{where}: no 'prompt' or 'messages' column (rm_stage.prompts rows need one); "
                             f"the row has {sorted(row)[:12]}")
        turns = [t for t in row_turns(row[col], where, col) if t["role"] != "assistant"]
        answer = "" if row.get("answer") is None else str(row["answer"]).strip()
        probs.append(Problem(id=first + j, prompt=fmt.prompt(turns, where), answer=answer, key=where, row=dict(row)))
    if tokenizer is not None and context_len:
        cap = context_len - cfg.rollout.max_new_tokens
        lens = tokenizer([p.prompt for p in probs], add_special_tokens=False)["input_ids"]
        for p, ids in zip(probs, lens):
            if len(ids) > cap:
                raise ValueError(f"{p.key}: the prompt is {len(ids)} tokens; the model's context {context_len} − "
                                 f"rollout.max_new_tokens {cfg.rollout.max_new_tokens} leaves {cap}")
    routed = cfg.rewards.models if cfg.rm_stage.route else {}
    return MixedTask(probs, base, {k: v for k, v in routed.items() if k in cfg.rm_stage.functions})


def check_stage(cfg, tokenizer, base, context_len: Optional[int] = None) -> Optional[tuple]:
    """The stage's own (task, rewards), built and checked at load (`fastgrpo.pipeline.load_run`):
    its prompt rows and its rewards, reward models loaded (and kept) now, before the policy model
    or any engine starts; `run_stage` trains with them. None when the run has no stage."""
    if not cfg.rm_stage.steps:
        return None
    from fastgrpo.rewards.registry import build_rewards

    scfg = stage_config(cfg)
    task = build_stage_task(cfg, tokenizer, base, context_len)
    try:
        return task, build_rewards(scfg.rewards, task, cfg.rollout.max_new_tokens, getattr(cfg, "config_dir", None))
    except ValueError as e:  # the stage's functions are rm_stage's fields
        raise ValueError(str(e).replace("rewards.functions", "rm_stage.functions")) from None


def _policy_path(cfg, log: Log) -> str:
    """What the stage starts from: the RLVR stage's latest checkpoint (else its SFT model)."""
    from fastgrpo.runs.checkpoint import latest_checkpoint

    out = cfg.logging.out_dir
    latest = latest_checkpoint(out, log=log)
    if latest is not None:
        return os.path.join(latest, "model")
    from fastgrpo.models import lora

    sft = os.path.join(out, "sft", "model")
    if os.path.isfile(os.path.join(sft, "config.json")) or lora.is_adapter_dir(sft):  # a LoRA run's: its adapter
        from fastgrpo.trainer.sft import sft_model_problem

        why = sft_model_problem(sft)  # verified against its marker before use
        if why is not None:
            raise ValueError(f"config rm_stage: the RLVR stage's SFT model does not verify ({why}); run the RLVR stage "
                             "again (move sft/model aside) or restore it")
        return sft
    raise ValueError(f"config rm_stage: the RLVR stage left no model in {out} to continue from "
                     "(set checkpoint.at_end=true, or steps > 0)")


def run_stage(cfg, log: Log, summary: Dict, parts=None) -> Dict:
    """The stage after RLVR (nothing when rm_stage.steps = 0); returns `summary` with the
    stage's figures under `rm_stage/…`. `parts`: the run's RunParts (fastgrpo.trainer.build),
    whose `stage` holds the stage's task and rewards built at load; built here when absent."""
    if not cfg.rm_stage.steps:
        return summary
    from fastgrpo.config import dump_config
    from fastgrpo.rewards.registry import build_rewards
    from fastgrpo.trainer.build import build_model, build_task, build_tokenizer
    from fastgrpo.runs.checkpoint import latest_checkpoint
    from fastgrpo.trainer.evaluation import evaluate
    from fastgrpo.trainer.grpo import Trainer, seed_everything
    from fastgrpo.runs.folder import graceful_signals

    t0 = time.perf_counter()
    scfg = stage_config(cfg)
    out = scfg.logging.out_dir
    os.makedirs(out, exist_ok=True)
    dump_config(scfg, os.path.join(out, "config.yaml"))
    resume = latest_checkpoint(out, log=log) if scfg.checkpoint.resume == "auto" else None
    # built from the RLVR model even on resume (the checkpoint's weights are loaded after): that
    # model is the stage's KL reference, resumed or not
    scfg.model.path = _policy_path(cfg, log)
    seed_everything(scfg.seed)
    if parts is None:  # a caller without the run's parts (the library path): build them as load_run does
        tok, ctx = build_tokenizer(cfg.model)
        base = build_task(cfg.data, tok, context_len=ctx, max_new_tokens=cfg.rollout.max_new_tokens)
        stage = check_stage(cfg, tok, base, ctx)
    else:
        tok, base, stage = parts.tokenizer, parts.task, parts.stage
    task, stage_rewards = stage
    model, tok = build_model(scfg.model, tokenizer=tok)
    evals = build_rewards(dataclasses.replace(cfg.rewards, functions=["accuracy"], weights=[1.0]), base,
                          cfg.rollout.max_new_tokens) if task.heldout else None
    if scfg.rollout.mode == "async":  # rollout workers on Ray (fastgrpo/trainer/async_trainer.py)
        from fastgrpo.trainer.async_trainer import AsyncTrainer as Trainer
    trainer = Trainer(scfg, model, tok, task, log=log, rewards=stage_rewards)
    log(f"[fastgrpo] stage 2 (RM-GRPO): {len(task.train)} prompts of {cfg.rm_stage.prompts}, "
        f"rewards {scfg.rewards.functions}, {scfg.steps} steps from {scfg.model.path}; run folder {out}")
    res: Dict[str, float] = {}
    try:
        if resume is not None:
            trainer.resume(resume)
            log(f"[fastgrpo] stage 2 resumed from {resume} at step {trainer.step_num}")
        elif evals is not None:
            ev = evaluate(trainer.engine, task.heldout, evals, cfg.eval, cfg.rollout)
            trainer.metrics.log(0, ev)
            res["rm_stage/accuracy_before"] = ev.get("eval/accuracy")
        bar = None
        if cfg.logging.progress and trainer.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=scfg.steps, initial=trainer.step_num, desc="rm-grpo", dynamic_ncols=True, leave=True)
        with graceful_signals(trainer.request_stop):
            trainer.train(on_step=lambda s, m: bar is not None and bar.update(1))
        if bar is not None:
            bar.close()
        trainer.stop_if_signalled()  # a signal during the stage's final save: no evaluation after it
        if evals is not None:
            trainer.sync_engine()
            ev = evaluate(trainer.engine, task.heldout, evals, cfg.eval, cfg.rollout)
            trainer.metrics.log(trainer.step_num, ev)
            res["rm_stage/accuracy_after"] = ev.get("eval/accuracy")
        res.update({"rm_stage/steps": trainer.step_num, "rm_stage/wall_s": time.perf_counter() - t0})
    finally:
        trainer.close()
    if trainer.rank == 0:
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(res, f, indent=1)
        log(f"[fastgrpo] stage 2 done: {trainer.step_num} steps, held-out accuracy "
            f"{res.get('rm_stage/accuracy_before', 'resumed')} → {res.get('rm_stage/accuracy_after')}; run folder {out}")
    return {**summary, **res}


def earlier_summary(cfg) -> Dict:
    """The RLVR stage's summary.json when it is skipped on resume."""
    try:
        with open(os.path.join(cfg.logging.out_dir, "summary.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
