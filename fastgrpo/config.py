"""Run configuration: one dataclass per concern, loaded from YAML with `--set a.b=value` overrides.

Follows the house style (shared/DESIGN.md rule 5): every field carries an inline comment, YAML
maps onto the dataclasses one key per field, and an unknown key or an invalid value fails at load
time with the dotted field name (`algorithm.eps_low=-1: expected ...`). The defaults suit a
pretrained model (RL learning rates, no SFT unless asked, the task's accuracy reward); the
embedded demo (`fastgrpo train` with no arguments, fastgrpo/demo/default.py) sets its own values
for its tiny from-scratch model. `AlgorithmConfig.loss_config()` maps the loss fields onto the
kernels' `LossConfig`, which validates them once more.
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import yaml


@dataclass
class ModelConfig:
    path: str = "tiny"  # "tiny" builds the char tokenizer + tiny model below; else a HF path / run checkpoint dir
    arch: str = "qwen2"  # tiny model family: qwen2 or llama
    hidden_size: int = 64  # tiny model width (64 keeps a CPU step well under a second)
    num_hidden_layers: int = 2  # tiny model depth
    intermediate_size: int = 128  # tiny model MLP width
    num_attention_heads: int = 2  # tiny model heads (head_dim 32: vLLM's CPU attention needs ≥ 32)
    dtype: str = "float32"  # float32 | bfloat16 (training dtype of the parameters; float16 is refused: AdamW on fp16 weights without a loss scale overflows)
    seed: int = 0  # initialisation seed of the tiny model
    gradient_checkpointing: bool = False  # recompute activations in backward (memory for time)


@dataclass
class DataConfig:
    task: str = "auto"  # auto (arithmetic without data.path, else math) | arithmetic | math | code | jsonl (= math)
    path: Optional[str] = None  # train data: a .jsonl / .json / .parquet / .csv file, a datasets save_to_disk folder, or a hub id
    eval_path: Optional[str] = None  # held-out data (same forms); without it, eval_fraction of path is held out
    eval_fraction: float = 0.0  # seeded fraction of path's rows held out when there is no eval_path
    split: str = "train"  # split used for training when path is a dataset dict / hub dataset
    eval_split: Optional[str] = None  # split used as held-out when path is a dataset dict (e.g. "test")
    columns: Dict[str, str] = field(default_factory=dict)  # problem field → column: prompt | messages | answer | tests | id | completion
    system_prompt: Optional[str] = None  # system message (with a chat template) or a text prefix (without)
    few_shot: int = 0  # the first k train rows with a reference completion, shown as example turns before each prompt
    chat_template: str = "auto"  # auto (the tokenizer's template when it has one) | on (required) | off (raw text)
    enable_thinking: Optional[bool] = None  # passed to apply_chat_template (Qwen3's thinking switch); None = not passed
    answer_format: str = "auto"  # math answer extraction: auto | tags | boxed | gsm8k | last_number | regex:<pattern>
    answer_tag: str = "answer"  # the tag of answer_format=tags (and of auto's first try)
    max_prompt_tokens: int = 0  # a longer prompt is an error naming its row (0 = the model's context − rollout.max_new_tokens)
    limit: int = 0  # use only the first N rows of path (0 = all)
    max_operand: int = 50  # arithmetic: operands drawn from [0, max_operand)
    num_heldout: int = 200  # arithmetic: problems kept out of training for eval/accuracy
    seed: int = 0  # split / shuffling seed


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (fastgrpo.rollout.choose_engine: the faster engine for the model and device) | vllm | torch
    group_size: int = 8  # G: completions per prompt
    prompts_per_step: int = 8  # prompts per rollout batch (G·prompts sequences)
    temperature: float = 1.0  # sampling temperature; also the loss temperature τ
    top_p: float = 1.0  # nucleus sampling (1 = off, keeps the sampling distribution = the policy)
    top_k: int = 0  # top-k sampling (0 = off, as in SamplingConfig; -1, the older spelling of off, reads as 0)
    max_new_tokens: int = 256  # completion length cap; longer completions count as truncated
    stop: List[str] = field(default_factory=list)  # stop strings (kept in the completion, like a stop token)
    thinking_budget: int = 0  # Qwen3 thinking budget: after this many tokens without think_end the interrupt is forced (0 = off)
    answer_budget: int = 64  # thinking budget: tokens generated after the interrupt
    think_end: str = "</think>"  # thinking budget: the string that closes the reasoning
    interrupt: str = ""  # thinking budget: text forced when the budget runs out ("" = Qwen3's "Considering the limited time…")
    max_model_len: int = 0  # vLLM context (0 = the longest prompt + the completion budget, capped at the model's context)
    gpu_memory_utilization: float = 0.3  # vLLM: fraction of accelerator memory for weights + KV cache
    sleep_between_steps: bool = False  # vLLM: release KV cache during the update (colocated engine)

    def __post_init__(self):
        if self.top_k == -1:  # one meaning of "off" everywhere: 0
            self.top_k = 0


# the rewards `rewards.functions` can name (built by fastgrpo.rewards.registry.build_rewards)
REWARD_NAMES = {
    "accuracy": "the task's verifier (math: answer equivalence; code: its unit tests in the sandbox)",
    "format": "R1 layout: one <think>…</think> then one <answer>…</answer> (rewards.format_think_tag / format_answer_tag)",
    "language": "share of the chain of thought in rewards.language's script (DeepSeek-R1's language consistency)",
    "kimi_length": "Kimi K1.5 length reward per group, on once a batch's accuracy reaches rewards.kimi_min_accuracy",
    "overlong": "DAPO soft overlong penalty over the last rewards.overlong_cache tokens of rollout.max_new_tokens",
    "code": "unit tests of the problem's `tests` run in the sandbox (rewards.code_timeout seconds each)",
}


def check_reward_name(name: str, task_rewards: Sequence[str] = (), syntax_only: bool = False) -> Optional[str]:
    """None when `name` is a known reward (the library's or one of `task_rewards`) or a
    `module:function` path; else what is expected. `syntax_only` (the config's own check, which
    cannot know the task's rewards) accepts any identifier."""
    if not isinstance(name, str):
        return "a reward name or 'module:function'"
    if name in REWARD_NAMES or name in task_rewards:
        return None
    if name.count(":") == 1 and all(part.strip() for part in name.split(":")):
        return None
    if syntax_only and name.isidentifier():
        return None
    return f"one of {sorted(set(REWARD_NAMES) | set(task_rewards))} or a user function as 'module:function'"



@dataclass
class RewardsConfig:
    # accuracy | format | language | kimi_length | overlong | code, or a user function as module:function
    # (TRL's reward-function signature accepted; fastgrpo/rewards/registry.py)
    functions: List[str] = field(default_factory=lambda: ["accuracy"])
    weights: List[float] = field(default_factory=lambda: [1.0])  # weight of each function in the total
    on_error: str = "zero"  # a reward fn that raises: "zero" scores error_score, "drop" drops the group
    error_score: float = 0.0  # score given to a completion whose reward fn raised (on_error=zero)
    format_think_tag: str = "think"  # format: the reasoning block's tag (also language's)
    format_answer_tag: str = "answer"  # format: the answer block's tag ("" = any text after the reasoning)
    format_strict: bool = True  # format: the whole completion is exactly the two blocks
    language: str = "en"  # language: the target language of the chain of thought
    kimi_min_accuracy: float = 0.3  # kimi_length: on once a batch's mean accuracy reaches this (and stays on)
    kimi_min_step: int = 0  # kimi_length: also on after this many steps (0 = only by accuracy)
    overlong_cache: int = 0  # overlong: DAPO's L_cache, the last tokens of rollout.max_new_tokens penalised (0 = a quarter)
    code_timeout: float = 5.0  # code: seconds per program run in the sandbox


@dataclass
class AlgorithmConfig:
    estimator: str = "grpo"  # advantage estimator: grpo | dr_grpo | rloo | kimi (fastgrpo.advantages)
    adv_std: str = "group"  # advantage scaling: group | batch | none
    drop_zero_std: bool = True  # skip groups whose rewards are all equal (they carry no gradient)
    dynamic_sampling: bool = False  # DAPO: resample prompts until the batch has no zero-σ group
    dynamic_max_rounds: int = 4  # dynamic sampling: at most this many sampling rounds per step
    inner_steps: int = 1  # K: updates per rollout batch reusing the stored old log-probs
    eps_low: float = 0.2  # lower clip: ratio clipped at 1 − eps_low
    eps_high: float = 0.28  # upper clip (DAPO clip-higher)
    dual_clip_c: Optional[float] = None  # dual clip for A < 0 (e.g. 3.0); None = off
    delta: Optional[float] = None  # δ cap on the unclipped ratio; None = off
    beta: float = 0.0  # KL-to-reference weight; 0 → no reference model is built
    kl: str = "k3"  # KL estimator: k1 | k2 | k3
    entropy_coef: float = 0.0  # α: entropy bonus
    ratio_level: str = "token"  # token (GRPO) | sequence (GSPO)
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    max_pass_rate: float = 0.9  # difficulty filter: retire prompts whose tracked pass rate exceeds this (1 = never)
    min_attempts: int = 8  # samples of a prompt before it can be retired (one lucky group must not)
    weighting: str = "inverse_pass"  # prompt sampling: inverse_pass (∝ 1 − pass rate, Qwen3) | uniform
    loss_impl: str = "auto"  # loss backend: auto | reference | torch | triton

    def loss_config(self, temperature: float, max_len: Optional[int] = None):
        """The kernels' LossConfig for these fields (it validates them once more)."""
        from fastgrpo.kernels.contract import LossConfig

        return LossConfig(temperature=temperature, eps_low=self.eps_low, eps_high=self.eps_high,
                          dual_clip_c=self.dual_clip_c, delta=self.delta, beta=self.beta, kl=self.kl,
                          entropy_coef=self.entropy_coef, ratio_level=self.ratio_level,
                          loss_agg=self.loss_agg,
                          max_len=max_len if self.loss_agg == "seq-mean-token-sum-norm" else None)


@dataclass
class PackingConfig:
    max_tokens: int = 4096  # token budget of one packed micro-batch (prompt + completion tokens)
    # a group's prompt runs through the model once for its G completions, where the packing cost
    # model expects a gain (CPU models; GPU / flash-attention models always pack unshared):
    # same log-probs and gradients, fewer tokens
    share_prefix: bool = True


@dataclass
class OptimizerConfig:
    lr: float = 1e-6  # AdamW peak learning rate of GRPO: 1e-6 (TRL, verl) .. 3e-6 (DeepSeek-R1) for a pretrained model; the demo sets its own
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])  # AdamW β1, β2
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    eps: float = 1e-8  # AdamW ε
    max_grad_norm: float = 1.0  # global gradient-norm clip (0 = off)
    schedule: str = "constant"  # constant | linear | cosine (decay to min_lr_ratio·lr over the run)
    warmup_steps: int = 0  # linear warmup from 0 over this many optimizer steps
    min_lr_ratio: float = 0.0  # final lr / peak lr of linear and cosine schedules


@dataclass
class SFTConfig:
    steps: int = 100  # SFT cold-start optimizer steps (short on purpose: RL needs headroom)
    batch_size: int = 16  # sequences per SFT step
    lr: float = 1e-5  # SFT learning rate (AdamW, constant; the demo's from-scratch model uses 3e-3)
    noise: float = 0.0  # fraction of SFT traces whose answer is corrupted (noisy cold start)
    max_grad_norm: float = 1.0  # gradient clip of SFT (0 = off)


@dataclass
class EvalConfig:
    num_samples: int = 1  # n samples per held-out prompt (1 = greedy accuracy); eval/pass@n is logged
    pass_k: List[int] = field(default_factory=list)  # also log eval/pass@k for these k <= n (unbiased estimator)
    temperature: float = 0.0  # 0 = greedy; > 0 samples (needed for pass@k with k > 1)
    max_problems: int = 200  # cap on held-out problems evaluated
    every: int = 0  # eval every N GRPO steps (0 = only before and after)


@dataclass
class SyncConfig:
    # between syncs the engine's rollouts are off-policy: their sampling log-probs are the old log-probs
    every: int = 1  # push trainer weights to the rollout engine every N steps


@dataclass
class LoggingConfig:
    out_dir: str = "runs/default"  # run folder: metrics.jsonl, events, plots, checkpoints
    log_every: int = 1  # write metrics every N steps
    tensorboard: bool = True  # TensorBoard events when tensorboard is importable
    plots: bool = True  # PNG plots (reward, accuracy, length, KL) at the end of the run
    progress: bool = True  # progress bar with live reward and throughput
    nvtx: bool = False  # NVTX ranges per phase (also FASTGRPO_NVTX=1 / --nvtx)


@dataclass
class CheckpointConfig:
    every: int = 50  # checkpoint every N steps (0 = only at the end); with sync.every > 1 at the first synced step from there
    keep_last: int = 2  # checkpoints kept (the newest complete one is never deleted)
    resume: str = "auto"  # auto (latest in out_dir) | none | a checkpoint directory
    at_end: bool = True  # write a checkpoint when the run ends


@dataclass
class DistributedConfig:
    backend: str = "none"  # none | deepspeed | ddp
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0..3
    rank: int = 0  # this process's rank (set from the launcher's RANK when the trainer starts)
    world_size: int = 1  # number of training processes (set from the launcher's WORLD_SIZE)
    local_rank: int = 0  # device index on this node (set from the launcher's LOCAL_RANK)


@dataclass
class GuardConfig:
    # beyond finiteness (non-finite losses / gradients always skip the update, max_nan_skips):
    max_weight_growth: float = 1.5  # an update that grows the global weight norm by more than this factor stops the run, unsaved (0 = off)
    grad_spike: float = 0.0  # skip an update whose gradient norm exceeds this × the median of the last 20 (0 = off; e.g. 50)
    grad_spike_warmup: int = 5  # updates seen before the spike guard acts


@dataclass
class TrainConfig:
    steps: int = 200  # GRPO steps (rollout batches)
    seed: int = 0  # global seed (python, numpy, torch, sampling)
    max_nan_skips: int = 5  # stop after this many skipped NaN/Inf steps
    sft_first: bool = False  # run the SFT cold start before GRPO (needs a reference completion in every train row; the demo sets it)
    threads: int = 0  # torch CPU threads (0 = torch's default); 1 wins at tiny sizes: OpenMP spin-waits cost 20× on a busy 2-core box
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)


# ---------------------------------------------------------------------------------------------
# value checks: (field path, predicate, expected form)
# ---------------------------------------------------------------------------------------------

def _choice(*opts):
    return (lambda v: v in opts), f"one of {list(opts)}"


_POS = (lambda v: v > 0), "a number > 0"
_NONNEG = (lambda v: v >= 0), "a number >= 0"
_PROB = (lambda v: 0 <= v <= 1), "a number in [0, 1]"
_POS_INT = (lambda v: v >= 1), "an integer >= 1"

_CHECKS = {
    "steps": _NONNEG, "max_nan_skips": _POS_INT, "threads": _NONNEG,
    "model.arch": _choice("qwen2", "llama"), "model.dtype": _choice("float32", "bfloat16"),
    "model.hidden_size": _POS_INT, "model.num_hidden_layers": _POS_INT,
    "model.intermediate_size": _POS_INT, "model.num_attention_heads": _POS_INT,
    "data.task": _choice("auto", "arithmetic", "math", "code", "jsonl"),
    "data.eval_fraction": ((lambda v: 0 <= v < 1), "a number in [0, 1)"), "data.few_shot": _NONNEG,
    "data.chat_template": _choice("auto", "on", "off"), "data.max_prompt_tokens": _NONNEG, "data.limit": _NONNEG, "data.max_operand": ((lambda v: v >= 2), "an integer >= 2"),
    "data.num_heldout": _NONNEG,
    "rollout.engine": _choice("auto", "vllm", "torch"), "rollout.group_size": ((lambda v: v >= 2), "an integer >= 2 (a group needs a baseline)"),
    "rollout.prompts_per_step": _POS_INT, "rollout.temperature": _POS, "rollout.top_p": ((lambda v: 0 < v <= 1), "a number in (0, 1]"),
    "rollout.top_k": ((lambda v: v >= -1), "0 (off) or an integer >= 1"),
    "rollout.max_new_tokens": _POS_INT, "rollout.thinking_budget": _NONNEG, "rollout.answer_budget": _POS_INT,
    "rollout.max_model_len": _NONNEG, "rollout.gpu_memory_utilization": ((lambda v: 0 < v <= 1), "a number in (0, 1]"),
    "rewards.on_error": _choice("zero", "drop"), "rewards.kimi_min_accuracy": _PROB, "rewards.kimi_min_step": _NONNEG,
    "rewards.overlong_cache": _NONNEG, "rewards.code_timeout": _POS,
    "algorithm.estimator": _choice("grpo", "dr_grpo", "rloo", "kimi"), "algorithm.adv_std": _choice("group", "batch", "none"),
    "algorithm.inner_steps": _POS_INT, "algorithm.dynamic_max_rounds": _POS_INT, "algorithm.max_pass_rate": _PROB, "algorithm.min_attempts": _POS_INT,
    "algorithm.weighting": _choice("inverse_pass", "uniform"),
    "algorithm.loss_impl": _choice("auto", "reference", "torch", "triton"),
    "packing.max_tokens": _POS_INT,
    "optimizer.lr": _POS, "optimizer.weight_decay": _NONNEG, "optimizer.eps": _POS, "optimizer.max_grad_norm": _NONNEG,
    "optimizer.schedule": _choice("constant", "linear", "cosine"), "optimizer.warmup_steps": _NONNEG,
    "optimizer.min_lr_ratio": _PROB,
    "sft.steps": _NONNEG, "sft.batch_size": _POS_INT, "sft.lr": _POS, "sft.noise": _PROB, "sft.max_grad_norm": _NONNEG,
    "eval.num_samples": _POS_INT, "eval.temperature": _NONNEG, "eval.max_problems": _POS_INT, "eval.every": _NONNEG,
    "sync.every": _POS_INT,
    "guard.max_weight_growth": ((lambda v: v == 0 or v > 1), "0 (off) or a factor > 1"), "guard.grad_spike": ((lambda v: v == 0 or v > 1), "0 (off) or a factor > 1"),
    "guard.grad_spike_warmup": _NONNEG,
    "logging.log_every": _POS_INT,
    "checkpoint.every": _NONNEG, "checkpoint.keep_last": _POS_INT,
    "distributed.backend": _choice("none", "deepspeed", "ddp"), "distributed.zero_stage": _choice(0, 1, 2, 3),
    "distributed.rank": _NONNEG, "distributed.world_size": _POS_INT, "distributed.local_rank": _NONNEG,
}


def _bad(path: str, value, want: str):
    raise ValueError(f"config {path}={value!r}: expected {want}")


def _coerce(path: str, value, tp):
    """Check `value` against the annotated type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(path, value, args[0])
    if origin in (dict, Dict):
        kt, vt = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, dict):
            _bad(path, value, "a mapping")
        return {_coerce(f"{path}.{k}", k, kt): _coerce(f"{path}.{k}", v, vt) for k, v in value.items()}
    if origin in (list, List, Sequence):
        (item,) = typing.get_args(tp) or (Any,)
        if not isinstance(value, (list, tuple)):
            _bad(path, value, f"a list of {getattr(item, '__name__', item)}")
        return [_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            _bad(path, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _bad(path, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, str) and _SCI.match(value.strip()):  # YAML 1.1 leaves "1e-3" a string
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _bad(path, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _bad(path, value, "a string")
        return value
    return value


def _from_dict(cls, data: Dict[str, Any], prefix: str = ""):
    if not isinstance(data, dict):
        _bad(prefix.rstrip(".") or "<root>", data, f"a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ValueError(f"config {prefix}{unknown[0]}: unknown field; {cls.__name__} has {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _from_dict(tp, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(f"{prefix}{k}", v, tp)
    return cls(**kwargs)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range / choice checks of every field (types were checked while loading)."""
    if cfg.model.dtype == "float16":
        _bad("model.dtype", "float16", "float32 or bfloat16: float16 parameters under AdamW without a loss scale "
             "overflow to NaN (bfloat16 has the same memory and float32's range)")
    flat = to_dict(cfg)
    for path, (ok, want) in _CHECKS.items():
        value = flat
        for part in path.split("."):
            value = value[part]
        if not ok(value):
            _bad(path, value, want)
    for i, name in enumerate(cfg.rewards.functions):
        why = check_reward_name(name, syntax_only=True)
        if why is not None:
            _bad(f"rewards.functions[{i}]", name, why)
    if len(cfg.rewards.functions) != len(cfg.rewards.weights):
        # a typo in a name is the likelier fault than the weights: say so first
        for i, name in enumerate(cfg.rewards.functions):
            why = check_reward_name(name)
            if why is not None:
                _bad(f"rewards.functions[{i}]", name, f"{why} (and rewards.weights one weight per entry)")
        _bad("rewards.weights", cfg.rewards.weights, f"{len(cfg.rewards.functions)} weights, one per rewards.functions entry")
    if len(cfg.optimizer.betas) != 2 or not all(0 <= b < 1 for b in cfg.optimizer.betas):
        _bad("optimizer.betas", cfg.optimizer.betas, "two numbers in [0, 1)")
    if cfg.data.task in ("math", "code", "jsonl") and not cfg.data.path:
        _bad("data.path", cfg.data.path, f"a data file, dataset folder or hub id when data.task={cfg.data.task}")
    if cfg.data.task == "arithmetic" and cfg.data.path:
        _bad("data.task", cfg.data.task, "math or code (or auto) when data.path is given (arithmetic is the built-in task)")
    if cfg.data.answer_format not in ("auto", "tags", "boxed", "gsm8k", "last_number") and not cfg.data.answer_format.startswith("regex:"):
        _bad("data.answer_format", cfg.data.answer_format, "one of auto, tags, boxed, gsm8k, last_number, regex:<pattern>")
    known_cols = ("prompt", "messages", "answer", "tests", "id", "completion")
    for k, v in cfg.data.columns.items():
        if k not in known_cols:
            _bad(f"data.columns.{k}", v, f"a mapping from problem fields {list(known_cols)} to column names")
    r = cfg.rollout
    if any(not x for x in r.stop):
        _bad("rollout.stop", r.stop, "non-empty stop strings")
    if r.thinking_budget and r.thinking_budget + r.answer_budget > r.max_new_tokens:
        _bad("rollout.thinking_budget", r.thinking_budget, f"thinking_budget + answer_budget ({r.answer_budget}) <= "
             f"rollout.max_new_tokens={r.max_new_tokens} (the interrupt's tokens count too; the loss normalises by that cap)")
    if r.thinking_budget and not r.think_end:
        _bad("rollout.think_end", r.think_end, "the string that closes the reasoning when thinking_budget is set")
    if cfg.eval.num_samples > 1 and cfg.eval.temperature == 0:
        _bad("eval.temperature", cfg.eval.temperature, "> 0 when eval.num_samples > 1 (pass@k needs sampling)")
    for i, k in enumerate(cfg.eval.pass_k):
        if not 1 <= k <= cfg.eval.num_samples:
            _bad(f"eval.pass_k[{i}]", k, f"an integer in [1, eval.num_samples={cfg.eval.num_samples}]")
    if cfg.distributed.rank >= cfg.distributed.world_size:
        _bad("distributed.rank", cfg.distributed.rank, f"< distributed.world_size={cfg.distributed.world_size}")
    try:
        cfg.algorithm.loss_config(cfg.rollout.temperature, cfg.rollout.max_new_tokens)
    except ValueError as e:  # LossConfig names its own field; name it as the config's field
        raise ValueError(f"config {str(e).replace('LossConfig.', 'algorithm.')}") from None
    return cfg


def to_dict(cfg) -> Dict[str, Any]:
    return dataclasses.asdict(cfg)


_SCI = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def parse_override(item: str):
    """`a.b=value` → (["a", "b"], value parsed as YAML: 3 → int, 1e-3 → float, [1, 2] → list)."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected the form section.field=value, e.g. optimizer.lr=1e-3")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"--set {item!r}: empty field name before '='")
    value = yaml.safe_load(raw) if raw.strip() else ""
    # YAML 1.1 reads "1e-3" as a string (its floats need a dot); take it as the float a user means
    if isinstance(value, str) and _SCI.match(value.strip()):
        value = float(value)
    return key.split("."), value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    for item in overrides or ():
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            nxt = node.setdefault(k, {})
            if not isinstance(nxt, dict):
                raise ValueError(f"--set {item!r}: {k} is a value, not a section")
            node = nxt
        node[keys[-1]] = value
    return data


def load_config(path: Optional[str] = None, overrides: Sequence[str] = (), base: Optional[Dict[str, Any]] = None) -> TrainConfig:
    """Defaults ← `base` dict ← YAML file at `path` ← `--set` overrides; then validate."""
    data: Dict[str, Any] = {}
    if base:
        data = _merge(data, base)
    if path:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {path}: expected a YAML mapping of sections, got {type(loaded).__name__}")
        data = _merge(data, loaded)
    data = apply_overrides(data, overrides)
    return validate(_from_dict(TrainConfig, data))


def _merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dump_config(cfg: TrainConfig, path: str) -> None:
    """Write the config as YAML: a temp file, fsynced, renamed over `path` (never a torn file)."""
    import os

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
