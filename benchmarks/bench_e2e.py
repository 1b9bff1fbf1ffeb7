"""End to end GRPO step on CPU: fastgrpo's Trainer vs TRL's GRPOTrainer (and TRL with the
fastgrpo drop-in loss), same tiny model, same prompt pool, same G, same completion length cap,
one process, one run.

A step is everything between two optimizer updates: sampling G completions for P prompts,
rewards, advantages, the forward/backward of the loss, the optimizer. Both trainers generate
with their own engine (fastgrpo: its built-in torch engine; TRL: `model.generate`, use_vllm=False),
use AdamW, β = 0, one update per rollout batch (K = 1), temperature 1, no gradient
accumulation (fastgrpo's packing budget holds the whole batch: one micro-batch, as TRL's one
padded batch). A randomly initialised model rarely earns a reward, so zero-σ groups are kept in
fastgrpo (algorithm.drop_zero_std=false) exactly as TRL keeps them: both do the full update.

Side by side: each TRL step is followed by one fastgrpo step (a TRL callback), so both see
the same machine load; the speed-up of a pair is TRL's median / fastgrpo's median over the
steps interleaved with it. Reported per case: seconds per step (median / p20 / p80 of the measured steps after warm-up)
and tokens/s = (prompt + completion tokens of the step's P·G sequences) / step time, with the
completion lengths each trainer actually produced. There is no byte/FLOP floor here: the ratio
fastgrpo / TRL, measured side by side, is the figure (target ≥ 3×).

The completion cap is swept (default 32, 128, 256 new tokens): the random model stops at an EOS
now and then, so completions spread in length and the cap sets both the decode length and how
much padding TRL's padded batch carries. Each cap gets its own fresh pair of trainers.

    python -m benchmarks.bench_e2e --prompts 8 --group 8 --max-new-tokens 32 128 256 --steps 5
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.harness import Bench, Stats, _quantile


def _stats(samples):
    if not samples:
        raise ValueError("no measured steps: expected --steps >= 1")
    return Stats(statistics.median(samples), _quantile(samples, 0.2), _quantile(samples, 0.8), list(samples))


class FastgrpoStepper:
    """fastgrpo's Trainer, stepped one optimizer update at a time (so that its steps can be
    interleaved with TRL's, under the same machine load)."""

    def __init__(self, a, out_dir):
        from fastgrpo.config import load_config
        from fastgrpo.trainer.grpo import Trainer

        cfg = load_config(overrides=[
            f"steps={10 ** 6}", f"seed={a.seed}", "sft_first=false",
            "rollout.engine=torch", f"rollout.group_size={a.group}", f"rollout.prompts_per_step={a.prompts}",
            f"rollout.max_new_tokens={a.max_new_tokens}", "rollout.temperature=1.0",
            "algorithm.drop_zero_std=false", "algorithm.max_pass_rate=1.0", "algorithm.beta=0.0",
            "algorithm.inner_steps=1", f"optimizer.lr={a.lr}",
            f"logging.out_dir={out_dir}", "logging.tensorboard=false", "logging.plots=false",
            "logging.progress=false", "checkpoint.at_end=false", "checkpoint.every=0", "checkpoint.resume=none",
        ])
        self.trainer = Trainer(cfg, log=lambda *_: None)
        # one micro-batch per update, as TRL's side runs (per_device_train_batch_size = P·G, no
        # gradient accumulation): a budget that holds every sequence at the cap
        tok, task = self.trainer.tokenizer, self.trainer.task
        longest = max(len(tok(p.prompt, add_special_tokens=False)["input_ids"]) for p in task.train)
        self.trainer.cfg.packing.max_tokens = a.prompts * a.group * (longest + a.max_new_tokens)
        self.times, self.tokens, self.phases = [], [], {}

    def step(self, record: bool = True):
        t0 = time.perf_counter()
        logs = self.trainer.step()
        dt = time.perf_counter() - t0
        if record:
            self.times.append(dt)
            self.tokens.append(logs["perf/throughput"] * logs["timing/step"])  # prompt + completion tokens
            for k, v in logs.items():
                if k.startswith("timing/") and k != "timing/step":
                    self.phases.setdefault(k, []).append(v)


def _trl_parts(a):
    from datasets import Dataset

    from fastgrpo.trainer.build import build_model, build_task
    from fastgrpo.config import load_config
    from fastgrpo.models.onednn import restore_linears
    from fastgrpo.models.fused_layer import restore_layers

    cfg = load_config(overrides=[f"seed={a.seed}"])
    model, tok = build_model(cfg.model)  # the same tiny model fastgrpo's Trainer builds
    # ... with the plain nn.Linear and decoder layers a TRL user's HF model has (fastgrpo's
    # build_model puts float32 CPU linears on oneDNN, fastgrpo.models.onednn, and packed training
    # forwards through fused layers, fastgrpo.models.fused_layer: fastgrpo's, not TRL's)
    restore_linears(model)
    restore_layers(model)
    task = build_task(cfg.data)
    n = a.prompts * (a.warmup + a.steps + 1)
    rows = task.train[:n]
    data = Dataset.from_dict({"prompt": [p.prompt for p in rows], "answer": [p.answer for p in rows]})
    fns = task.reward_fns()
    weights = dict(zip(cfg.rewards.functions, cfg.rewards.weights))

    def reward(completions, answer, **kw):  # fastgrpo's weighted total, as one TRL reward function
        parts = [fns[name](completions, answer) for name in weights]
        return [sum(w * p[i] for w, p in zip(weights.values(), parts)) for i in range(len(completions))]

    return model, tok, data, reward


def run_trl(a, out_dir, drop_in: bool, fast: FastgrpoStepper):
    """TRL's training loop; after each of its steps, one fastgrpo step (timed apart)."""
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tok, data, reward = _trl_parts(a)
    args = GRPOConfig(
        output_dir=out_dir, use_vllm=False, num_generations=a.group, per_device_train_batch_size=a.prompts * a.group,
        gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=a.max_new_tokens,
        max_steps=a.warmup + a.steps, learning_rate=a.lr, beta=0.0, temperature=1.0, loss_type="dapo",
        epsilon=0.2, epsilon_high=0.28, report_to="none", logging_steps=1, save_strategy="no", use_cpu=True,
        bf16=False, seed=a.seed, dataloader_num_workers=0, disable_tqdm=True, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1.0, adam_beta2=0.99, log_level="error")
    times = []

    class Interleave(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.t0)
            fast.step(record=len(times) > a.warmup)

    if drop_in:
        from fastgrpo.integrations.trl import FastGRPOTrainer as cls
    else:
        cls = GRPOTrainer
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                  callbacks=[Interleave()])
    trainer.train()
    if drop_in and trainer._fastgrpo_fallbacks:
        raise RuntimeError("the drop-in fell back to TRL's loss: the comparison would be meaningless")
    prompt_len = sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in data["prompt"]) / len(data)
    comp = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [a.prompts * a.group * (prompt_len + c) for c in comp]
    return times[a.warmup:], tokens[a.warmup:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="P: prompts per step")
    ap.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[32, 128, 256],
                    help="completion length caps to sweep (both trainers; one fresh pair per cap)")
    ap.add_argument("--steps", type=int, default=5, help="measured steps (>= 5: medians)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured first steps")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--no-drop-in", action="store_true", help="skip the TRL + fastgrpo loss case")
    a = ap.parse_args(argv)
    for name in ("prompts", "group", "steps"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)}: expected an integer >= 1")
    if any(n < 1 for n in a.max_new_tokens):
        raise ValueError(f"--max-new-tokens={a.max_new_tokens}: expected integers >= 1")
    if a.steps < 5:
        print(f"[bench_e2e] note: --steps={a.steps} < 5, medians of few samples")
    if a.threads:
        torch.set_num_threads(a.threads)
    bench = Bench("e2e")
    pairs = [("TRL GRPOTrainer", False)] + ([] if a.no_drop_in else [("TRL + fastgrpo loss", True)])
    caps = list(a.max_new_tokens)
    summary = []
    for cap in caps:
        a.max_new_tokens = cap
        shape = f"P={a.prompts},G={a.group},L={cap},tiny-qwen2"

        def add(case, times, tokens, base_s):
            st = _stats(times)
            tps = statistics.median([t / s for t, s in zip(tokens, times)])
            bench.add(case=case, shape=shape, stats=st,
                      extra={"s_per_step": round(st.median_s, 3), "tokens_per_s": round(tps, 1),
                             "speedup_vs_trl": round(base_s / st.median_s, 2)})
            return base_s / st.median_s

        phases = {}
        with tempfile.TemporaryDirectory() as d:
            fast = FastgrpoStepper(a, d)
            for case, drop_in in pairs:
                fast.times, fast.tokens, fast.phases = [], [], {}
                times, tokens = run_trl(a, d, drop_in, fast)
                base = statistics.median(times)
                speedup = add(f"fastgrpo Trainer (interleaved with {case})", fast.times, fast.tokens, base)
                add(case, times, tokens, base)
                phases.update({f"{k} (vs {case})": statistics.median(v) for k, v in fast.phases.items()})
                summary.append(f"L={cap} vs {case}: {speedup:.2f}x")
            fast.trainer.close()
        # where fastgrpo's step goes (its own phase timers, medians): the figure to read the ratio by
        print(f"fastgrpo phases at L={cap}, median s: "
              + ", ".join(f"{k}={v:.3f}" for k, v in sorted(phases.items())))
    bench.finish()
    print("fastgrpo speed-up (target >= 3x): " + "; ".join(summary))


if __name__ == "__main__":
    main()
