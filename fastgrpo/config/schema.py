"""The run configuration's schema: one dataclass per concern, every field with an inline comment
(shared/DESIGN.md rule 5), and the names of the built-in rewards. Loading, the value checks and
`--set` overrides are fastgrpo/config/load.py; `fastgrpo.config` exports both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from fastgrpo.config.lora import LoRAConfig  # model.lora (its checks: fastgrpo/config/lora.py)


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
    extra_tokens: List[str] = field(default_factory=list)  # tiny model: single tokens added to its character tokenizer after its own ids (the tool demo's <tool_call> … tags)
    gradient_checkpointing: bool = False  # recompute activations in backward (memory for time)
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # LoRA adapter through PEFT (rank 0 = off: full fine-tuning)


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
    max_operand: int = 50  # arithmetic: operands drawn from [min_operand, max_operand)
    min_operand: int = 0  # arithmetic: the smallest operand (the tool demo: 317, so that every product has six digits)
    operation: str = "+"  # arithmetic: + (the demo's sums) | * (the tool demo's products, beyond the tiny model's head)
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
    # the asynchronous schedule (fastgrpo/workers/, fastgrpo/trainer/async_trainer.py)
    mode: str = "colocated"  # colocated (one process, phases in turn) | async (rollout workers on Ray, generating while the trainer updates)
    workers: int = 1  # async: rollout worker actors, one engine each (the built-in engine)
    max_staleness: int = 1  # async: η, how many policy versions behind a trained sample may be (0 = lock-step); enforced by admission, never by dropping
    inflight: str = "wait"  # async: weights that arrive during a generate call: wait (they load at the next call) | keep (loaded between two decode steps, the tokens so far keep their cache) | abort (loaded there, the tokens so far re-prefilled); either engine (vLLM: not with lora.sync=adapter)
    deterministic: bool = False  # async: logical clock (swaps at fixed points, results in submission order, per-prompt seeds): two runs, one seed, same weights (a dead worker's prompts rerun under their admission version)
    worker_threads: int = 1  # async: torch threads of each CPU rollout worker (its Ray CPU request too)
    prompts_per_call: int = 0  # async: prompts per generate call of a worker (0 = prompts_per_step / workers; deterministic: 1)
    # multi-turn episodes (fastgrpo/episodes/, fastgrpo/rollout/episodes.py): on when tools or env is set;
    # rollout.max_new_tokens is then the episode's token budget (sampled + tool / environment ids after the prompt)
    tools: List[str] = field(default_factory=list)  # tools the model may call: calculator, python (the code sandbox) or module:function / file.py:function (typed, with a docstring)
    env: str = ""  # an environment class module:Class / file.py:Class (reset(row) -> str | None, step(text) -> (obs, reward, done)), one instance per episode, out of process
    max_turns: int = 4  # model turns per episode
    history: str = "auto"  # a chat template that rewrites earlier turns (Qwen3's <think> stripping): keep (train the ledger as sampled) | fork (a new sample from there); auto: refuse such a template
    episode_groups: int = 2  # episodes in flight: k groups, one decoding while the others' tools run (1 = turn-synchronous; benchmarks/bench_tools.py: k = 2 best at 135M on CPU)
    episode_batching: str = "auto"  # auto | continuous | groups: continuous = every live episode's turn in one running decode batch, joining as its tools answer, its KV cache kept between turns (the built-in engine on Qwen2 / Qwen3 / Llama); groups = engine calls of episode_groups groups (vLLM); auto = continuous where the engine can
    tool_timeout: float = 10.0  # wall-clock seconds of one tool call or environment reset / step; then its process group is killed
    tool_output_chars: int = 2000  # characters of one tool result the model reads (the rest is cut, with a note)
    tool_parallel: int = 4  # tool calls running at once over all episodes (one warm worker each)
    tool_parallel_per_episode: int = 2  # tool calls of one episode running at once
    tool_errors: str = "continue"  # a tool error, timeout or unparsable call: continue (back to the model as text) | stop (the episode ends)
    turn_rewards: str = "outcome"  # an environment's per-turn rewards: outcome (their sum is the `env` reward, scored with the final answer) | dense (also per-token: each turn's reward normalised over its group, credited to that turn's and earlier turns' tokens)
    turn_reward_weight: float = 1.0  # turn_rewards=dense: weight of the per-turn advantages added to each sampled token's

    @property
    def episodes(self) -> bool:
        """Multi-turn episodes are on (rollout.tools or rollout.env set)."""
        return bool(self.tools) or bool(self.env)

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
    "process": "step scores of rewards.process.scorer reduced to one reward (rewards.process.reduction: min | product | mean)",
    "env": "the environment's own reward (rollout.env: the sum of its step rewards over the episode; 0 when it gave none)",
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
class ProcessConfig:
    # process rewards (fastgrpo/rewards/process.py): steps of a completion scored one by one
    scorer: str = ""  # "" = off | a built-in (arithmetic) | module:function / file.py:function, fn(prompt, steps, answer) -> one score per step
    delimiter: str = "\n"  # steps = the non-blank pieces between delimiters (when regex is "")
    regex: str = ""  # steps = the matches of this pattern (re.DOTALL), e.g. "<think>.*?</think>|<answer>.*?</answer>"
    reduction: str = "min"  # the reward `process` in rewards.functions: min | product | mean of the step scores
    dense_weight: float = 0.0  # w: token t of step k gets A_t = A_outcome + w·(group-normalised step score); 0 = off
    dense_credit: str = "step"  # step (a token gets its own step's score) | to_go (the sum over its step and later ones, DeepSeekMath)


@dataclass
class RewardModelConfig:  # one entry of rewards.models (fastgrpo/rewards/judge.py)
    kind: str = "classifier"  # classifier (AutoModelForSequenceClassification, one logit) | judge (a causal LM asked `rubric`)
    path: str = ""  # HF model folder of the reward model / judge
    device: str = "auto"  # its own torch device: auto (cuda when present, else cpu) | cpu | cuda:1 …
    dtype: str = "float32"  # float32 | bfloat16 | float16 (inference only, no optimizer)
    batch_size: int = 16  # texts per forward
    max_length: int = 0  # tokens per scored text, cut from the left (0 = the model's context)
    normalize: str = "none"  # none (raw scores) | group (z-score within each group of G; a σ=0 group scores 0)
    rubric: str = ""  # judge: the prompt, with {prompt} {completion} {answer} (chat template applied when it has one)
    labels: List[str] = field(default_factory=lambda: [str(i) for i in range(10)])  # judge: answer strings, one token each
    values: List[float] = field(default_factory=list)  # judge: the score of each label (empty = the labels read as numbers)
    score: str = "logprobs"  # judge: logprobs (label probabilities at the next position) | generate (greedy text, first label or number)
    min_mass: float = 1e-3  # judge logprobs: label probability below which an item has no score (→ rewards.error_score)
    max_new_tokens: int = 16  # judge generate: tokens generated before parsing


@dataclass
class RewardsConfig:
    # accuracy | format | language | kimi_length | overlong | code | process (rewards.process), or a user function as module:function
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
    # a user reward runs in a worker process, replaced when it overruns; a call past the timeout scores
    # error_score and is counted (reward/<name>/timeouts); 0: user rewards run in the trainer process
    timeout: float = 60.0  # seconds per call of a user or model reward (fastgrpo/rewards/worker.py); 0 = none
    models: Dict[str, RewardModelConfig] = field(default_factory=dict)  # name → reward model / judge, listed by name in functions
    accuracy_judge: str = ""  # math accuracy: a judge of `models` asked only when the symbolic parse fails ("" = off)
    process: ProcessConfig = field(default_factory=ProcessConfig)  # process (step-level) rewards


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
    # off-policy correction (fastgrpo/correction.py) of rollouts sampled behind the policy (async, sync.every > 1):
    # auto (decoupled under rollout.mode=async, else none) | none (naive PPO: clip around the engine's log-probs μ)
    # | decoupled (AReaL: clip around π_prox, weight π_prox/μ, tokens above is_cap masked) | tis (weight min(π_prox/μ, is_cap))
    correction: str = "auto"
    is_cap: float = 2.0  # C of the correction, > 1: tis truncates π_prox/μ at C, decoupled masks tokens above C (AReaL's examples: 5)
    correction_on_policy: bool = False  # also correct on-policy steps for engine–trainer numeric mismatch (Yao et al. 2025; +1 no-grad forward a step)

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
    timeout: float = 300.0  # async: seconds any weight broadcast, worker RPC or wait for a worker may take before the run stops naming it
    bucket_mb: int = 256  # async: broadcast bucket size in MiB (two buckets in flight)
    overlap: bool = True  # async: the broadcast runs while the trainer computes the next step (its optimizer step waits for it); false: the trainer waits at each sync
    transport: str = "auto"  # async: how a broadcast reaches the workers: auto (shm when every worker is a CPU worker on this node, else group) | group (the gloo / NCCL group) | shm (one shared-memory segment the workers copy from)


@dataclass
class WandbConfig:  # Weights & Biases, optional (fastgrpo/logs/wandb_logger.py); metrics.jsonl stays the record
    mode: str = "disabled"  # disabled (no wandb at all) | online | offline (no network; `wandb sync <run>/wandb/offline-run-*` later)
    project: str = "fastgrpo"  # W&B project
    name: str = ""  # W&B run name ("" = the run folder's name)


@dataclass
class LoggingConfig:
    out_dir: str = "runs/default"  # run folder: metrics.jsonl, events, plots, checkpoints
    log_every: int = 1  # write metrics every N steps
    tensorboard: bool = True  # TensorBoard events when tensorboard is importable
    plots: bool = True  # PNG plots (reward, accuracy, length, KL) at the end of the run
    progress: bool = True  # progress bar with live reward and throughput
    nvtx: bool = False  # NVTX ranges per phase (also FASTGRPO_NVTX=1 / --nvtx)
    samples_every: int = 10  # every N steps some of the step's rollouts go to <run>/samples.jsonl (0 = off, eval_samples.jsonl too)
    samples_max: int = 8  # rows per step: best and worst completion of a few groups, one row per σ = 0 group
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases (off by default)


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
class RMStageConfig:  # the second stage after RLVR: GRPO on a mixed prompt set (fastgrpo/recipes/stages.py)
    steps: int = 0  # GRPO steps of the stage (0 = no second stage)
    prompts: Optional[str] = None  # mixed prompt set (.jsonl, … as data.path): rows with a prompt, an answer where verifiable
    functions: List[str] = field(default_factory=list)  # the stage's rewards (names as in rewards.functions or rewards.models)
    weights: List[float] = field(default_factory=list)  # one weight per functions entry
    lr: float = 0.0  # the stage's peak learning rate (0 = optimizer.lr)
    route: bool = True  # R1's split: rewards.models score only rows without an answer (false: every row)
    beta: float = 0.0  # the stage's KL weight to its start (the RLVR model) as the reference (0 = algorithm.beta)


@dataclass
class FusionConfig:
    # thinking-mode fusion (Qwen3 §4.3; fastgrpo/recipes/fusion.py): SFT on the RL model's verified traces + direct answers
    enabled: bool = False  # run it after GRPO in `fastgrpo train` (`fastgrpo fuse` runs it on a trained model alone)
    group_size: int = 4  # completions sampled per train prompt to find verified traces
    max_prompts: int = 0  # train prompts sampled for traces (0 = all)
    temperature: float = 1.0  # sampling temperature of the trace collection (0 = greedy: one trace per prompt)
    min_accuracy: float = 1.0  # a trace is kept when its accuracy reward reaches this (1 = only reward-1 traces; format 1 too when the run has it)
    think_ratio: float = 0.5  # fraction of thinking examples in the mix (the rest answer directly)
    mix_size: int = 0  # examples in the mix (0 = two per verified trace)
    think_flag: str = ""  # appended to the user's message in thinking mode (Qwen3's soft switch: " /think"; "" = the prompt as RL saw it)
    no_think_flag: str = " /no_think"  # appended to the user's message in non-thinking mode
    no_think_prefix: str = "<think></think>"  # opens a direct answer: the empty think block (Qwen3: "<think>\n\n</think>\n\n"); the template's when it switches
    template_switch: str = "auto"  # auto: the chat template's enable_thinking when it reads one | always (required) | never (flags only)
    think_start: str = "<think>"  # opens the reasoning: a budget of 0 forces think_start + rollout.interrupt
    interrupted_fraction: float = 0.0  # departure from Qwen3: thinking examples cut at a random point and closed by rollout.interrupt (0 = off)
    steps: int = 100  # SFT optimizer steps on the mix
    batch_size: int = 0  # sequences per SFT step (0 = sft.batch_size)
    lr: float = 0.0  # SFT learning rate on the mix (0 = sft.lr)
    budget_fractions: List[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])  # sweep: fractions of the full thinking budget
    full_budget: int = 0  # sweep: the thinking budget at fraction 1, tokens (0 = the longest think span of the verified traces)
    sweep_before: bool = True  # sweep the RL model too, before fusion (the baseline of plots/budget_sweep.png)


@dataclass
class ClusterConfig:
    # Ray for rollout.mode=async (fastgrpo/workers/cluster.py)
    address: str = ""  # "" = start a local Ray sized from this config; host:port (or "auto") joins a running cluster (`ray start --head`)
    num_cpus: int = 0  # local Ray: CPUs it may hand out (0 = rollout.workers × rollout.worker_threads)
    num_gpus: int = 0  # local Ray: GPUs it may hand out (0 = every visible GPU)
    object_store_mb: int = 200  # local Ray: object store size in MiB (rollouts and prompts pass through it)
    gpus_per_worker: float = -1.0  # GPUs per rollout worker (-1 = 1 when the cluster has GPUs, else 0)


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
    fusion: FusionConfig = field(default_factory=FusionConfig)
    rm_stage: RMStageConfig = field(default_factory=RMStageConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # Ray, for rollout.mode=async
