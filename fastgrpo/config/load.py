"""Loading the run configuration: defaults ← a base dict ← YAML ← `--set a.b=value` overrides, each
value checked against its field's annotated type while loading and against its range / choices
after (`validate`); an unknown key or an invalid value fails with the dotted field name
(`algorithm.eps_low=-1: expected ...`)."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from typing import Any, Dict, List, Optional, Sequence

import yaml

from fastgrpo.config.lora import check_lora_config
from fastgrpo.config.schema import REWARD_NAMES, RewardsConfig, TrainConfig, check_reward_name

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
    "data.chat_template": _choice("auto", "on", "off"), "data.max_prompt_tokens": _NONNEG, "data.limit": _NONNEG, "data.max_operand": ((lambda v: v >= 2), "an integer >= 2"), "data.min_operand": _NONNEG,
    "data.operation": _choice("+", "*"),
    "data.num_heldout": _NONNEG,
    "rollout.engine": _choice("auto", "vllm", "torch"), "rollout.group_size": ((lambda v: v >= 2), "an integer >= 2 (a group needs a baseline)"),
    "rollout.prompts_per_step": _POS_INT, "rollout.temperature": _POS, "rollout.top_p": ((lambda v: 0 < v <= 1), "a number in (0, 1]"),
    "rollout.top_k": ((lambda v: v >= -1), "0 (off) or an integer >= 1"),
    "rollout.max_new_tokens": _POS_INT, "rollout.thinking_budget": _NONNEG, "rollout.answer_budget": _POS_INT,
    "rollout.max_model_len": _NONNEG, "rollout.gpu_memory_utilization": ((lambda v: 0 < v <= 1), "a number in (0, 1]"),
    "rewards.on_error": _choice("zero", "drop"), "rewards.kimi_min_accuracy": _PROB, "rewards.kimi_min_step": _NONNEG,
    "rewards.overlong_cache": _NONNEG, "rewards.code_timeout": _POS,
    "rewards.timeout": ((lambda v: v >= 0), "a number of seconds >= 0 (0 = no timeout)"),
    "rewards.process.reduction": _choice("min", "product", "mean"), "rewards.process.dense_weight": _NONNEG,
    "rewards.process.dense_credit": _choice("step", "to_go"),
    "algorithm.estimator": _choice("grpo", "dr_grpo", "rloo", "kimi"), "algorithm.adv_std": _choice("group", "batch", "none"),
    "algorithm.inner_steps": _POS_INT, "algorithm.dynamic_max_rounds": _POS_INT, "algorithm.max_pass_rate": _PROB, "algorithm.min_attempts": _POS_INT,
    "algorithm.weighting": _choice("inverse_pass", "uniform"),
    "algorithm.loss_impl": _choice("auto", "reference", "torch", "triton"),
    "algorithm.correction": _choice("auto", "none", "tis", "decoupled"),
    "algorithm.is_cap": ((lambda v: v > 1), "a number > 1 (the truncation C of the importance weights; 2 is Yao et al.'s, 5 AReaL's)"),
    "packing.max_tokens": _POS_INT,
    "optimizer.lr": _POS, "optimizer.weight_decay": _NONNEG, "optimizer.eps": _POS, "optimizer.max_grad_norm": _NONNEG,
    "optimizer.schedule": _choice("constant", "linear", "cosine"), "optimizer.warmup_steps": _NONNEG,
    "optimizer.min_lr_ratio": _PROB,
    "sft.steps": _NONNEG, "sft.batch_size": _POS_INT, "sft.lr": _POS, "sft.noise": _PROB, "sft.max_grad_norm": _NONNEG,
    "eval.num_samples": _POS_INT, "eval.temperature": _NONNEG, "eval.max_problems": _POS_INT, "eval.every": _NONNEG,
    "sync.every": _POS_INT, "sync.timeout": _POS, "sync.bucket_mb": _POS_INT, "sync.transport": _choice("auto", "group", "shm"),
    "rollout.mode": _choice("colocated", "async"), "rollout.workers": _POS_INT, "rollout.max_staleness": _NONNEG,
    "rollout.inflight": _choice("wait", "abort", "keep"), "rollout.worker_threads": _POS_INT,
    "rollout.prompts_per_call": _NONNEG,
    "rollout.max_turns": ((lambda v: v >= 1), "an integer >= 1 (model turns per episode)"),
    "rollout.history": _choice("auto", "keep", "fork"), "rollout.episode_groups": _POS_INT,
    "rollout.episode_batching": _choice("auto", "continuous", "groups"),
    "rollout.tool_timeout": _POS, "rollout.tool_output_chars": _POS_INT, "rollout.tool_parallel": _POS_INT,
    "rollout.tool_parallel_per_episode": _POS_INT, "rollout.tool_errors": _choice("continue", "stop"),
    "rollout.turn_rewards": _choice("outcome", "dense"), "rollout.turn_reward_weight": _NONNEG,
    "cluster.num_cpus": _NONNEG, "cluster.num_gpus": _NONNEG, "cluster.object_store_mb": ((lambda v: v >= 64), "an integer >= 64 (MiB)"),
    "cluster.gpus_per_worker": ((lambda v: v == -1 or v >= 0), "-1 (auto) or a number >= 0"),
    "guard.max_weight_growth": ((lambda v: v == 0 or v > 1), "0 (off) or a factor > 1"), "guard.grad_spike": ((lambda v: v == 0 or v > 1), "0 (off) or a factor > 1"),
    "guard.grad_spike_warmup": _NONNEG,
    "logging.log_every": _POS_INT, "logging.samples_every": _NONNEG, "logging.samples_max": _POS_INT,
    "logging.wandb.mode": _choice("disabled", "online", "offline"),
    "logging.wandb.project": ((lambda v: bool(v.strip())), "a W&B project name"),
    "checkpoint.every": _NONNEG, "checkpoint.keep_last": _POS_INT,
    "distributed.backend": _choice("none", "deepspeed", "ddp"), "distributed.zero_stage": _choice(0, 1, 2, 3),
    "distributed.rank": _NONNEG, "distributed.world_size": _POS_INT, "distributed.local_rank": _NONNEG,
    "rm_stage.steps": _NONNEG, "rm_stage.lr": _NONNEG, "rm_stage.beta": _NONNEG,
    "fusion.group_size": _POS_INT, "fusion.max_prompts": _NONNEG, "fusion.temperature": _NONNEG,
    "fusion.min_accuracy": ((lambda v: 0 < v <= 1), "a number in (0, 1] (1 = only reward-1 traces)"),
    "fusion.think_ratio": _PROB, "fusion.mix_size": _NONNEG, "fusion.template_switch": _choice("auto", "always", "never"),
    "fusion.interrupted_fraction": _PROB, "fusion.steps": _NONNEG, "fusion.batch_size": _NONNEG,
    "fusion.lr": ((lambda v: v >= 0), "a number > 0 (0 = sft.lr)"), "fusion.full_budget": _NONNEG,
    "fusion.budget_fractions": ((lambda v: bool(v) and all(0 <= x <= 1 for x in v)),
                                "a non-empty list of fractions of the full thinking budget, each in [0, 1]"),
}
# each rewards.models.<name> (fastgrpo/rewards/judge.py)
_MODEL_CHECKS = {
    "kind": _choice("classifier", "judge"), "dtype": _choice("float32", "bfloat16", "float16"),
    "batch_size": _POS_INT, "max_length": _NONNEG, "normalize": _choice("none", "group"),
    "score": _choice("logprobs", "generate"), "min_mass": ((lambda v: 0 <= v < 1), "a number in [0, 1)"),
    "max_new_tokens": _POS_INT, "path": ((lambda v: bool(v.strip())), "the reward model's folder"),
}


def _bad(path: str, value, want: str):
    raise ValueError(f"config {path}={value!r}: expected {want}")


def _coerce(path: str, value, tp):
    """Check `value` against the annotated type `tp`; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):  # a mapping of sections (rewards.models.<name>)
        return _from_dict(tp, value, f"{path}.")
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
    _validate_models(cfg)
    check_lora_config(cfg.model.lora, _bad)  # model.lora (fastgrpo/config/lora.py)
    if len(cfg.rewards.functions) != len(cfg.rewards.weights):
        # a typo in a name is the likelier fault than the weights: say so first
        for i, name in enumerate(cfg.rewards.functions):
            why = check_reward_name(name, tuple(cfg.rewards.models))
            if why is not None:
                _bad(f"rewards.functions[{i}]", name, f"{why} (and rewards.weights one weight per entry)")
        _bad("rewards.weights", cfg.rewards.weights, f"{len(cfg.rewards.functions)} weights, one per rewards.functions entry")
    _check_process(cfg.rewards)
    _check_async(cfg)
    if len(cfg.optimizer.betas) != 2 or not all(0 <= b < 1 for b in cfg.optimizer.betas):
        _bad("optimizer.betas", cfg.optimizer.betas, "two numbers in [0, 1)")
    if cfg.data.task in ("math", "code", "jsonl") and not cfg.data.path:
        _bad("data.path", cfg.data.path, f"a data file, dataset folder or hub id when data.task={cfg.data.task}")
    for i, t in enumerate(cfg.model.extra_tokens):
        # a LoRA adapter's base name records them joined by "|" (fastgrpo.trainer.build.tiny_ref)
        if not isinstance(t, str) or len(t) < 2 or any(c.isspace() or c in ",=|" for c in t):
            _bad(f"model.extra_tokens[{i}]", t, "a token of 2 or more characters without whitespace, ',', '=' or '|' "
                 "(single characters are the tokenizer's own)")
    if cfg.data.min_operand + 2 > cfg.data.max_operand:
        _bad("data.min_operand", cfg.data.min_operand, f"at most data.max_operand - 2 = {cfg.data.max_operand - 2}")
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
    if r.turn_rewards == "dense" and not r.env:
        _bad("rollout.turn_rewards", r.turn_rewards, "outcome unless rollout.env is set (per-turn rewards are what an "
             "environment's step returns)")
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
    fu = cfg.fusion
    if fu.template_switch == "never" and fu.think_flag == fu.no_think_flag:
        _bad("fusion.no_think_flag", fu.no_think_flag, "a flag other than fusion.think_flag (with "
             "fusion.template_switch=never the flags are all that tells the two modes apart)")
    if fu.enabled and cfg.distributed.backend != "none":
        _bad("fusion.enabled", True, "false with distributed.backend != none (the fusion stage runs in one "
             "process: fuse the saved run with `fastgrpo fuse --set model.path=<run folder>`)")
    if cfg.distributed.rank >= cfg.distributed.world_size:
        _bad("distributed.rank", cfg.distributed.rank, f"< distributed.world_size={cfg.distributed.world_size}")
    if cfg.algorithm.correction_on_policy and cfg.algorithm.correction not in ("tis", "decoupled"):
        _bad("algorithm.correction_on_policy", True, "false unless algorithm.correction is tis or decoupled "
             f"(got algorithm.correction={cfg.algorithm.correction}: nothing would correct the on-policy mismatch)")
    try:
        cfg.algorithm.loss_config(cfg.rollout.temperature, cfg.rollout.max_new_tokens)
    except ValueError as e:  # LossConfig names its own field; name it as the config's field
        raise ValueError(f"config {str(e).replace('LossConfig.', 'algorithm.')}") from None
    return cfg


def _check_async(cfg: TrainConfig) -> None:
    """rollout.mode=async: options its workers cannot serve, more workers than this machine has
    devices for (a local cluster), a cluster.address nobody answers at — refused before any model
    or worker starts."""
    r, c = cfg.rollout, cfg.cluster
    if r.mode != "async":
        return
    if r.inflight != "wait" and r.engine != "torch" and cfg.model.lora.rank > 0 and cfg.model.lora.sync == "adapter":
        _bad("rollout.inflight", r.inflight, f"wait with model.lora.sync=adapter and rollout.engine={r.engine} (a vLLM "
             "request keeps the adapter it was submitted with: set model.lora.sync=merged or rollout.engine=torch)")
    if r.sleep_between_steps:
        _bad("rollout.sleep_between_steps", True, "false with rollout.mode=async (workers own their engines)")
    if cfg.sync.every != 1:
        _bad("sync.every", cfg.sync.every, "1 with rollout.mode=async (rollout.max_staleness bounds how old the workers' weights may be)")
    if r.top_k > 0 or r.top_p < 1:
        _bad("rollout.top_k" if r.top_k > 0 else "rollout.top_p", r.top_k if r.top_k > 0 else r.top_p,
             "top_k=0 and top_p=1 with rollout.mode=async (the workers' sampling log-probs are the behaviour "
             "policy's; truncation would make them another distribution's)")
    if not c.address:
        import os

        cpus = c.num_cpus or os.cpu_count() or 1
        if r.workers * r.worker_threads > cpus:
            _bad("rollout.workers", r.workers, f"at most {cpus // r.worker_threads} on this machine ({cpus} CPUs, "
                 f"rollout.worker_threads={r.worker_threads} each); lower it, or join a cluster with cluster.address")
        if c.gpus_per_worker > 0:
            import torch

            have = c.num_gpus or torch.cuda.device_count()
            if r.workers * c.gpus_per_worker > have:
                _bad("rollout.workers", r.workers, f"workers × cluster.gpus_per_worker <= the {have} GPUs of this machine")
    elif c.address != "auto":
        import socket

        host, _, port = c.address.rpartition(":")
        if c.address.startswith("ray://"):
            host, _, port = c.address[len("ray://"):].rpartition(":")
        if not host or not port.isdigit():
            _bad("cluster.address", c.address, "host:port of a Ray head (`ray start --head` prints it), \"auto\" or \"\" (local)")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            _bad("cluster.address", c.address, f"a reachable Ray head ({e.strerror or e}); start one with "
                 "`ray start --head --port=<port>` or leave cluster.address empty for a local Ray")


def _check_process(rcfg: RewardsConfig) -> None:
    """rewards.process: a compilable regex, a delimiter without one, a scorer wherever it is used
    (the scorer's import is checked by fastgrpo.rewards.registry.build_rewards, also at load)."""
    p = rcfg.process
    if p.regex:
        try:
            re.compile(p.regex)
        except re.error as e:
            _bad("rewards.process.regex", p.regex, f"a valid regular expression ({e})")
    elif not p.delimiter:
        _bad("rewards.process.delimiter", p.delimiter, "a non-empty step delimiter (or a rewards.process.regex)")
    if not p.scorer and "process" in rcfg.functions:
        _bad("rewards.process.scorer", p.scorer, "a step scorer (arithmetic, module:function or file.py:function) "
             "when rewards.functions lists 'process'")
    if not p.scorer and p.dense_weight > 0:
        _bad("rewards.process.scorer", p.scorer, "a step scorer when rewards.process.dense_weight > 0")


def _validate_models(cfg: TrainConfig) -> None:
    """rewards.models entries, rewards.accuracy_judge and the rm_stage section."""
    models = cfg.rewards.models
    for name, m in models.items():
        if not name.isidentifier() or name in REWARD_NAMES:
            _bad(f"rewards.models.{name}", name, f"an identifier that is not a built-in reward ({sorted(REWARD_NAMES)})")
        for key, (ok, want) in _MODEL_CHECKS.items():
            if not ok(getattr(m, key)):
                _bad(f"rewards.models.{name}.{key}", getattr(m, key), want)
        if m.kind == "judge" and (not m.rubric.strip() or not m.labels or (m.values and len(m.values) != len(m.labels))):
            _bad(f"rewards.models.{name}", {"rubric": m.rubric, "labels": m.labels, "values": m.values},
                 "a judge with a rubric, labels and one value per label (values empty: the labels read as numbers)")
    j = cfg.rewards.accuracy_judge
    if j and (j not in models or models[j].kind != "judge"):
        _bad("rewards.accuracy_judge", j, f"the name of a kind: judge entry of rewards.models ({sorted(models)})")
    s = cfg.rm_stage
    if s.steps:
        if not s.prompts:
            _bad("rm_stage.prompts", s.prompts, "the stage's prompt set (a data file) when rm_stage.steps > 0")
        if not s.functions or len(s.functions) != len(s.weights):
            _bad("rm_stage.weights", s.weights, f"one weight per rm_stage.functions entry ({s.functions}), at least one")
        for i, name in enumerate(s.functions):
            why = check_reward_name(name, syntax_only=True)
            if why is not None:
                _bad(f"rm_stage.functions[{i}]", name, why)


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
    cfg = validate(_from_dict(TrainConfig, data))
    # not a field (never written to config.yaml): the folder user functions are looked up in first
    # (fastgrpo.rewards.inputs.import_reward), so `my_rewards:fn` beside the config file imports
    cfg.config_dir = os.path.dirname(os.path.abspath(path)) if path else None
    return cfg


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
