"""The R1-style pipeline behind the CLI: SFT cold start → held-out eval → GRPO → held-out eval,
in one run folder (config.yaml, metrics.jsonl, tb/, plots/, sft/, checkpoints/, summary.json);
with `rm_stage.steps` > 0 then RM-GRPO on a mixed prompt set in <out>/rm_stage
(fastgrpo/recipes/stages.py).

`eval/accuracy` is logged to metrics.jsonl with step 0 for the SFT checkpoint and with the last
GRPO step at the end. A killed run started again with the same out_dir resumes from its latest
GRPO checkpoint (or from the saved SFT model when it died before the first one) and continues
exactly; the "before" accuracy is then read back from metrics.jsonl.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from typing import Callable, Dict, Optional

import torch

from fastgrpo.runs import checkpoint as ckpt
from fastgrpo.trainer.build import RunParts, build_model, build_rollout_engine, build_task
from fastgrpo.config import TrainConfig
from fastgrpo.trainer.backend import launcher_env
from fastgrpo.trainer.evaluation import evaluate
from fastgrpo.logs.console import bar_postfix, eval_order, number, restart_clock, run_folder_line
from fastgrpo.logs.metrics import make_plots, read_metrics, set_nvtx

Log = Callable[[str], None]


def _progress(total: int, initial: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)


def _build_model(cfg: TrainConfig, parts: RunParts, log: Log):
    """build_model, announced when it is a model of your own: from_pretrained of a 7B model takes
    minutes, and nothing said so (issue 34). The tiny demo model builds in milliseconds."""
    if cfg.model.path != "tiny":
        log(f"[fastgrpo] loading the model {cfg.model.path} …")
    return build_model(cfg.model, tokenizer=parts.tokenizer)


def _prepare(cfg: TrainConfig):
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.logging.nvtx:
        set_nvtx(True)
    os.makedirs(cfg.logging.out_dir, exist_ok=True)


def load_run(cfg: TrainConfig, log: Log = print, need_sft: bool = False, verb: str = "trained") -> RunParts:
    """A run's parts (tokenizer, task, rewards; the RM stage's task and rewards), each built once
    and handed down to the stages, every input checked before the model or any engine starts:
    the tokenizer and context of model.path, the task's rows (columns, chat template, prompt
    lengths against the context, reference answers), the reward names and user functions, SFT's
    need for reference completions. Raises ValueError naming the problem."""
    from fastgrpo.rewards.registry import build_rewards
    from fastgrpo.trainer.build import build_tokenizer
    from fastgrpo.recipes.stages import check_stage

    from fastgrpo.trainer.build import load_episode_parts

    tok, ctx = build_tokenizer(cfg.model)
    check_demo_task(cfg, tok, verb)
    check_context(cfg, ctx)
    # rollout.tools / rollout.env: imported (beside the config file too) and checked now
    episodes = load_episode_parts(cfg.rollout, tok, getattr(cfg, "config_dir", None))
    task = build_task(cfg.data, tok, context_len=ctx, max_new_tokens=cfg.rollout.max_new_tokens,
                      tools=episodes.prompt_tools if episodes else None)
    rewards = build_rewards(cfg.rewards, task, cfg.rollout.max_new_tokens, getattr(cfg, "config_dir", None))
    stage = check_stage(cfg, tok, task, ctx)  # rm_stage: its prompts and reward models, loaded now
    from fastgrpo.trainer.lora_run import check_lora_run

    check_lora_run(cfg)  # model.lora / an adapter model.path against the model's layers and the engine
    r = cfg.checkpoint.resume
    if r not in ("auto", "none"):  # an explicit checkpoint: checked now, not after an engine has started
        why = ckpt.verify_checkpoint(r) if os.path.isdir(r) else f"{r} is not a checkpoint folder"
        if why is not None:
            raise ValueError(f"config checkpoint.resume={r!r}: {why}")
    if need_sft and not hasattr(task, "sft_completion") and not getattr(task, "has_completions", False):
        raise ValueError(f"config sft_first=true: SFT needs a reference completion in every train row of {cfg.data.path} "
                         "(map one with data.columns.completion), or set sft_first=false")
    return RunParts(tokenizer=tok, context_len=ctx, task=task, rewards=rewards, stage=stage, episodes=episodes)


def check_demo_task(cfg: TrainConfig, tok, verb: str = "trained") -> None:
    """The built-in arithmetic task is the tiny demo model's (its character tokenizer writes it):
    a real model with no data.path would be trained (or scored) on it, 0.000 after minutes without a
    word (issue 34), so it is refused unless data.task=arithmetic asks for it."""
    from fastgrpo.models.tiny import is_char_tokenizer

    if cfg.data.task != "auto" or cfg.data.path or is_char_tokenizer(tok):
        return
    raise ValueError(f"config data.path is not set, so model.path={cfg.model.path!r} would be {verb} on the embedded "
                     "demo's character arithmetic (the tiny demo model's task); give data.path=<train data: a .jsonl "
                     "/ .parquet / .csv file, a datasets folder or a hub id>, or data.task=arithmetic to use the "
                     "demo task on purpose")


def check_context(cfg: TrainConfig, ctx: Optional[int]) -> None:
    """rollout.max_new_tokens must leave room for a prompt in the model's context (every engine:
    the built-in one would otherwise decode past its positions, vLLM refuse late)."""
    if not ctx:
        return
    r = cfg.rollout
    limit = min(ctx, r.max_model_len) if r.max_model_len else ctx
    what = (f"rollout.max_model_len={r.max_model_len}" if r.max_model_len and r.max_model_len < ctx
            else f"the context of model.path={cfg.model.path!r}, {ctx} tokens")
    if r.max_new_tokens >= limit:
        raise ValueError(f"config rollout.max_new_tokens={r.max_new_tokens}: must be below {what} (a prompt needs "
                         f"room too); set rollout.max_new_tokens to at most {limit} minus the longest prompt")


def _sft_stage(cfg: TrainConfig, model, tok, task, log: Log) -> None:
    from fastgrpo.trainer.sft import run_sft

    sft_dir = os.path.join(cfg.logging.out_dir, "sft", "model")
    if cfg.checkpoint.resume != "none" and os.path.exists(sft_dir):
        from fastgrpo.trainer.sft import load_saved_sft

        if load_saved_sft(model, sft_dir, log):  # verified against its marker's sha256 first
            log(f"[fastgrpo] SFT model found in {sft_dir}: skipping the cold start")
            return
    bar = _progress(cfg.sft.steps, 0, "sft", cfg.logging.progress and launcher_env().rank == 0)
    t0 = time.perf_counter()

    def on_step(step, m):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['sft/loss']:.3f}")

    try:
        run_sft(cfg, model, tok, task, out_dir=cfg.logging.out_dir, on_step=on_step, log=log)
    finally:
        if bar is not None:
            bar.close()
    log(f"[fastgrpo] SFT cold start: {cfg.sft.steps} steps in {time.perf_counter() - t0:.1f} s")


def _step_of(checkpoint: Optional[str]) -> int:
    """The GRPO step of a checkpoint folder `…/step-00000050` (0 for none)."""
    import re

    m = re.search(r"step-(\d+)", os.path.basename(os.path.normpath(checkpoint))) if checkpoint else None
    return int(m.group(1)) if m else 0


def _prompt_len(tok, problems) -> int:
    texts = [p.prompt for p in problems]
    return max((len(x) for x in tok(texts, add_special_tokens=False)["input_ids"]), default=0) if texts else 0


def run_train(cfg: TrainConfig, log: Log = print) -> Dict[str, float]:
    """SFT (cfg.sft_first) → eval → GRPO for cfg.steps → eval; returns a summary dict.

    Temporary files live in `<out_dir>/tmp` (removed at the end and at the next start);
    SIGINT / SIGTERM during GRPO end the run after the current step with a checkpoint
    (`TrainingInterrupted`); at any other moment, from the first check of the inputs to the
    return, they interrupt at once (`RunInterrupted`, a KeyboardInterrupt saying where: before any
    GRPO step, after the last one during the final evaluation or while closing, after the run
    finished)."""
    from fastgrpo.runs.folder import graceful_signals, run_tmpdir

    progress = {"where": BEFORE_GRPO}  # what the run has done, for the message of a signal that stops it at once
    with graceful_signals(None, where=lambda: progress["where"]):
        want_sft = cfg.sft_first and cfg.sft.steps > 0
        parts = load_run(cfg, log, need_sft=want_sft)  # every input checked before the run folder is touched
        from fastgrpo.runs.record import plan_resume

        plan = plan_resume(cfg)  # a resume's settings against the run's own record, before anything is written
        os.makedirs(cfg.logging.out_dir, exist_ok=True)
        from fastgrpo.trainer.backend import launcher_env
        from fastgrpo.runs.lock import RunLock

        # one run per folder: rank 0 holds the lock (the other ranks are its own processes)
        lock = RunLock(cfg.logging.out_dir, log=log) if launcher_env().rank == 0 else contextlib.nullcontext()
        with lock, run_tmpdir(cfg.logging.out_dir):
            from fastgrpo.recipes import stages  # rm_stage: RM-GRPO after RLVR, in <out_dir>/rm_stage

            done = stages.stage_started(cfg)  # resuming inside the stage: RLVR is done
            summary = stages.earlier_summary(cfg) if done else _train(cfg, log, parts, want_sft, plan, progress)
            if cfg.rm_stage.steps:
                progress["where"] = ("after the RLVR stage finished, during the RM stage (rm_stage); run the same "
                                     "command to resume it")
            summary = stages.run_stage(cfg, log, summary, parts)
            progress["where"] = FINISHED
        return summary


BEFORE_GRPO = "before any GRPO step finished; run the same command to resume"
FINISHED = "after the run finished (its last line above): nothing to redo"


def _train(cfg: TrainConfig, log: Log, parts: RunParts, want_sft: bool, plan=None,
           progress: Optional[Dict] = None) -> Dict[str, float]:
    from fastgrpo.trainer.grpo import Trainer
    from fastgrpo.runs.folder import graceful_signals

    from fastgrpo.trainer.grpo import seed_everything

    t_start = time.perf_counter()
    _prepare(cfg)
    out = cfg.logging.out_dir
    progress = progress if progress is not None else {}
    resume_path = None
    if cfg.checkpoint.resume == "auto":
        resume_path = ckpt.latest_checkpoint(out, log=log)
    elif cfg.checkpoint.resume != "none":
        resume_path = cfg.checkpoint.resume
    from fastgrpo.runs.record import plan_resume, write_record

    # config.yaml for a new run; a resume that changed settings says which and records them beside it,
    # once its checkpoint took them (a resume refused there leaves no config.resume-*.yaml behind)
    plan = plan if plan is not None else plan_resume(cfg)
    if resume_path is None:
        write_record(cfg, plan, 0, log)
    seed_everything(cfg.seed)
    task = parts.task
    model, tok = _build_model(cfg, parts, log)
    ran_sft = False
    if want_sft and resume_path is None:
        _sft_stage(cfg, model, tok, task, log)
        ran_sft = True
        progress["where"] = f"after the SFT cold start (saved in {out}/sft/model), {BEFORE_GRPO}"
    start = "SFT checkpoint" if ran_sft else f"initial model {cfg.model.path}"
    if cfg.rollout.mode == "async":  # rollout workers on Ray (fastgrpo/trainer/async_trainer.py)
        from fastgrpo.trainer.async_trainer import AsyncTrainer as Trainer
    trainer = Trainer(cfg, model, tok, task, log=log, rewards=parts.rewards, episodes=parts.episodes)
    rewards = parts.rewards
    before: Optional[float] = None
    summary: Dict[str, float] = {}
    try:
        if resume_path is not None:
            trainer.resume(resume_path)
            write_record(cfg, plan, _step_of(resume_path), log)
            log(f"[fastgrpo] resumed from {resume_path} at step {trainer.step_num}")
            rows = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r.get("step") == 0 and "eval/accuracy" in r]
            before = rows[-1]["eval/accuracy"] if rows else None
        else:
            trainer.metrics.drop_steps_after(-1)  # a run that died before its first checkpoint: every row is redone
        show = cfg.logging.progress and trainer.rank == 0
        if resume_path is None and task.heldout:
            ev = evaluate(trainer.engine, task.heldout, rewards, cfg.eval, cfg.rollout, progress=show)
            trainer.metrics.log(0, ev)
            before = ev.get("eval/accuracy")  # None: no verifier among the rewards (eval/reward/* instead)
            log(f"[fastgrpo] held-out accuracy before RL ({start}): {_acc(before)}")
        bar = _progress(cfg.steps, trainer.step_num, "grpo", show)
        first = [True]

        def on_step(step, m):
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.steps and task.heldout:
                trainer.sync_engine()  # evaluate the policy, not the weights of the last sync
                trainer.metrics.log(step, evaluate(trainer.engine, task.heldout, rewards, cfg.eval, cfg.rollout))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(bar_postfix(m))  # acc only when accuracy is a training reward
                if first[0]:  # its ETA leaves out the first step's one-time native builds and compiles
                    restart_clock(bar)
            first[0] = False

        t_rl = time.perf_counter()
        try:
            with graceful_signals(trainer.request_stop, where=lambda: f"at once during GRPO step {trainer.step_num} "
                                  "(a second signal); run the same command to resume from the last checkpoint"):
                trainer.train(on_step=on_step)
        finally:
            if bar is not None:
                bar.close()
        trainer.stop_if_signalled()  # a signal during the final save: stop as it said
        saved = " (checkpoint written)" if cfg.checkpoint.at_end and trainer.step_num > 0 else ""
        after = f"after the last GRPO step {trainer.step_num}{saved}"
        progress["where"] = f"{after}, during the final evaluation; run the same command to finish the run"
        rl_s = time.perf_counter() - t_rl
        summary.update(steps=trainer.step_num, rl_s=rl_s)
        if task.heldout:
            trainer.sync_engine()
            ev = evaluate(trainer.engine, task.heldout, rewards, cfg.eval, cfg.rollout, progress=show)
            trainer.metrics.log(trainer.step_num, ev)
            summary["accuracy_after"] = ev.get("eval/accuracy")
            summary["accuracy_before"] = before
            log(f"[fastgrpo] held-out accuracy: {_acc(before)} ({'resumed run' if resume_path else start}) → "
                f"{_acc(ev.get('eval/accuracy'))} after {trainer.step_num} GRPO step{'' if trainer.step_num == 1 else 's'}")
        if cfg.fusion.enabled and trainer.rank == 0:  # thinking-mode fusion of the RL model (fastgrpo/recipes/fusion.py)
            from fastgrpo.recipes.fusion import fusion_stage

            trainer.sync_engine()
            summary.update(fusion_stage(cfg, trainer.backend.module, tok, task, rewards, trainer.engine, log=log))
        progress["where"] = f"{after}, while closing the run (plots, summary.json); run the same command to finish it"
    finally:
        trainer.close()
    if cfg.logging.plots and trainer.rank == 0:
        make_plots(out)
    summary["wall_s"] = time.perf_counter() - t_start
    if trainer.rank == 0:
        import json

        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        log(f"{run_folder_line(out, cfg.logging.tensorboard, cfg.logging.plots)} — {summary['wall_s']:.0f} s total")
    progress["where"] = FINISHED
    return summary


def run_sft_only(cfg: TrainConfig, log: Log = print) -> Dict[str, float]:
    """`fastgrpo sft`: the cold start alone; the model lands in <out_dir>/sft/model."""
    _prepare(cfg)
    from fastgrpo.trainer.grpo import seed_everything

    seed_everything(cfg.seed)
    parts = load_run(cfg, log, need_sft=True)
    task, rewards = parts.task, parts.rewards
    model, tok = _build_model(cfg, parts, log)
    cfg.checkpoint.resume = "none"
    _sft_stage(cfg, model, tok, task, log)
    out = {}
    if task.heldout:
        engine = build_rollout_engine(cfg.rollout, model, tok, prompt_len=_prompt_len(tok, task.heldout))
        out = evaluate(engine, task.heldout, rewards, cfg.eval, cfg.rollout, progress=cfg.logging.progress)
        log(f"[fastgrpo] held-out accuracy after SFT: {_acc(out.get('eval/accuracy'))}")
    return out


def _acc(value: Optional[float]) -> str:
    """A held-out accuracy for the log: None where no reward is a verifier (eval/reward/* are logged)."""
    return "n/a (no verifier among the rewards: see eval/reward/* in metrics.jsonl)" if value is None else f"{value:.3f}"


def run_eval(cfg: TrainConfig, log: Log = print, allow_untrained: bool = False) -> Dict[str, float]:
    """`fastgrpo eval`: held-out accuracy and pass@k of model.path (a run folder works). The tiny
    demo model (model.path=tiny, the default) is built with random weights: scoring it is refused
    unless asked for (`allow_untrained`, the CLI's `--untrained`), so a forgotten model.path is
    never read as a trained model's accuracy."""
    if cfg.model.path == "tiny" and not allow_untrained:
        raise ValueError("fastgrpo eval: model.path is not set, so the model would be the tiny demo model with random "
                         "weights; give --set model.path=<run folder, checkpoint or model>, or --untrained to score "
                         "an untrained model on purpose")
    _prepare(cfg)
    parts = load_run(cfg, log, verb="scored")
    task, rewards = parts.task, parts.rewards
    if not task.heldout:
        raise ValueError("fastgrpo eval: the task has no held-out split (data.eval_path, data.eval_fraction or "
                         "data.eval_split; the built-in task: data.num_heldout)")
    d = cfg.data
    source = (f"data.eval_path={d.eval_path!r}" if d.eval_path else f"data.path={d.path!r}" if d.path
              else "the built-in arithmetic task (data.task=arithmetic)")
    log(f"[fastgrpo] eval: {len(task.heldout)} held-out problems of {source}, {cfg.eval.num_samples} "
        f"sample{'s' if cfg.eval.num_samples != 1 else ''} each")
    model, tok = _build_model(cfg, parts, log)
    engine = build_rollout_engine(cfg.rollout, model, tok, prompt_len=_prompt_len(tok, task.heldout))
    if parts.episodes is not None:  # rollout.tools / env: held-out episodes run with their tools, as in training
        from fastgrpo.trainer.build import build_episode_runner

        engine.episodes = build_episode_runner(cfg.rollout, engine, tok, parts.episodes)
    try:
        out = evaluate(engine, task.heldout, rewards, cfg.eval, cfg.rollout, log=log, progress=cfg.logging.progress)
    finally:
        if getattr(engine, "episodes", None) is not None:
            engine.episodes.close()
    for k in eval_order(out):
        log(f"{k}: {number(out[k])}")
    _write_eval_samples(cfg, out, log)
    return out


def _write_eval_samples(cfg: TrainConfig, result, log: Log) -> None:
    """`fastgrpo eval`'s completions in <out>/eval_samples.jsonl (the rows a training run's
    evaluations write, step 0, tag "eval", plus the `model` evaluated), unless
    logging.samples_every = 0. Appended: an --out that is a training run's folder keeps that run's
    own evaluation rows."""
    rows = getattr(result, "samples", None)
    if not rows or not cfg.logging.samples_every or launcher_env().rank != 0:
        return
    from fastgrpo.logs.samples import SamplesFile

    f = SamplesFile(os.path.join(cfg.logging.out_dir, "eval_samples.jsonl"), log)
    if f.open(from_step=2 ** 62):  # drops nothing but a torn last line
        f.write([{"step": 0, "tag": "eval", "model": str(cfg.model.path), **r} for r in rows])
        f.close()
        if not f.failed:
            log(f"[fastgrpo] held-out completions: {f.path} ({len(rows)} rows)")


def run_bench(cfg: TrainConfig, log: Log = print) -> Dict[str, float]:
    """`fastgrpo bench`: cfg.steps GRPO steps after the SFT cold start (when cfg.sft_first, so
    that rewards vary and the update phase runs), without eval or checkpoints; prints the median
    seconds per phase and tokens/s (the first step is warm-up and is left out)."""
    from fastgrpo.trainer.sft import run_sft
    from fastgrpo.trainer.grpo import Trainer, seed_everything

    _prepare(cfg)
    cfg.checkpoint.every, cfg.checkpoint.at_end, cfg.checkpoint.resume = 0, False, "none"
    seed_everything(cfg.seed)
    parts = load_run(cfg, log, need_sft=cfg.sft_first and cfg.sft.steps > 0)
    task = parts.task
    model, tok = _build_model(cfg, parts, log)
    if cfg.sft_first and cfg.sft.steps > 0:
        log(f"[fastgrpo] bench: the SFT cold start first ({cfg.sft.steps} steps, so that rewards vary) …")
        run_sft(cfg, model, tok, task)
    trainer = Trainer(cfg, model, tok, task, log=log, rewards=parts.rewards, episodes=parts.episodes)
    # each step said as it ends: bench printed nothing for 29 s (issue 34)
    log(f"[fastgrpo] bench: {cfg.steps} GRPO steps, the first a warm-up left out of the medians "
        "(one-time native builds and compiles land in it) …")
    rows = []
    t0 = [time.perf_counter()]

    def on_step(step, m):
        rows.append(m)
        now = time.perf_counter()
        log(f"[fastgrpo] bench: step {step}/{cfg.steps}{' (warm-up)' if len(rows) == 1 else ''} in {now - t0[0]:.1f} s")
        t0[0] = now

    try:
        trainer.train(on_step=on_step)
    finally:
        trainer.close()
    rows = rows[1:] or rows
    keys = sorted({k for r in rows for k in r if k.startswith("timing/") or k == "perf/throughput"})
    med = {k: statistics.median([r[k] for r in rows if k in r]) for k in keys}
    log(f"{'metric':<24}{'median':>12}")
    for k in keys:
        log(f"{k:<24}{med[k]:>12.4f}")
    return med
