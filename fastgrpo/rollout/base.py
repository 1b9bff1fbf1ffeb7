"""The rollout-engine interface: G sampled completions per prompt with their sampling log-probs.

Shared by the colocated vLLM engine (vllm_engine.py) and the built-in torch engine
(torch_engine.py). An engine implements one primitive, `_sample(prompt_ids, sampling)`: one
completion per prompt-id list; `generate` repeats prompts G times, tokenizes strings and, when
asked, applies a Qwen3-style thinking budget on top of the primitive.

Log-prob contract (both engines): `Completion.logprobs[i]` is the log-probability of token i
under the distribution it was sampled from — logits / temperature, then top-k, then top-p
(renormalised over the kept tokens; vLLM's `processed_logprobs`). With top_k = 0 and
top_p = 1 this equals the trainer's `log_softmax(z / τ)[y]`; with top-k/top-p it is larger
than the trainer's value for the same token (the truncated mass is renormalised away). Greedy
(temperature 0) reports `log_softmax(z)[y]` (τ = 1). Forced tokens (the thinking-budget
interrupt) carry log-prob 0 and `sampled_mask` 0 so the loss can mask them out.

Thinking budget (Qwen3 technical report, §4.3 "thinking budget"): when a completion reaches
`thinking_budget` tokens without closing `</think>`, the interrupt string is appended and
generation continues, from prompt + thinking + interrupt, for at most `answer_budget` tokens.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

DEFAULT_INTERRUPT = "\n\nConsidering the limited time, I have to give the solution based on the thinking directly now.\n</think>\n\n"


@dataclass
class SamplingConfig:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # nucleus mass kept, in (0, 1]
    top_k: int = 0                    # 0 = no top-k truncation
    max_new_tokens: int = 256         # completion budget (thinking + answer when no budget is set)
    stop: Tuple[str, ...] = ()        # stop strings (kept in the completion, like its tokens)
    stop_token_ids: Tuple[int, ...] = ()  # extra stop ids besides the tokenizer's eos
    seed: Optional[int] = None        # completion j of a call uses seed + j (reproducible)
    thinking_budget: Optional[int] = None  # tokens allowed before `</think>`; None = off
    answer_budget: int = 64           # tokens after the interrupt
    think_end: str = "</think>"       # closes the thinking part
    interrupt: str = DEFAULT_INTERRUPT  # appended when the thinking budget runs out

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: expected a number >= 0")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: expected a number in (0, 1]")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k!r}: expected an integer >= 0 (0 = off)")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(int(i) for i in self.stop_token_ids)
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must be non-empty")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: expected an integer or None")
        if self.thinking_budget is not None and not (isinstance(self.thinking_budget, int) and self.thinking_budget >= 1):
            raise ValueError(f"thinking_budget={self.thinking_budget!r}: expected an integer >= 1 or None")
        if not (isinstance(self.answer_budget, int) and self.answer_budget >= 1):
            raise ValueError(f"answer_budget={self.answer_budget!r}: expected an integer >= 1")


@dataclass
class Completion:
    token_ids: List[int]              # completion tokens (eos included when it stopped on eos)
    logprobs: List[float]             # per token, see the module docstring
    finish_reason: str                # "stop" (eos / stop id / stop string) or "length"
    text: str = ""                    # decoded completion, special tokens skipped
    sampled_mask: List[int] = field(default_factory=list)  # 1 = sampled, 0 = forced (interrupt)
    prompt_index: int = 0             # which prompt of the call it answers
    policy_version: Optional[int] = None  # weights version that sampled its first token (async workers; None = colocated)
    token_versions: Optional[List[int]] = None  # per token, from engines whose weights may change mid-call (rollout.inflight=keep | abort)

    def __post_init__(self):
        if not self.sampled_mask:
            self.sampled_mask = [1] * len(self.token_ids)


def token_versions(n: int, v0: int, swaps) -> List[int]:
    """Versions of a completion's `n` tokens: `v0`, then each swap's version from its first token
    (`swaps`: (index of the first token sampled under the new weights, their version), in order)."""
    out = [v0] * n
    for first, version in swaps:
        out[first:] = [version] * max(0, n - first)
    return out


Prompt = Union[str, Sequence[int]]


class RolloutEngine(abc.ABC):
    """Generate G completions per prompt; update weights from the trainer; sleep / wake."""

    tokenizer = None
    # called with the number of completions that just finished (a held-out evaluation's bar,
    # fastgrpo.trainer.evaluation); None = nobody is counting
    progress = None

    @abc.abstractmethod
    def _sample(self, prompt_ids: List[List[int]], sampling: SamplingConfig, max_new_tokens: int,
                seeds: List[Optional[int]]) -> List[Completion]:
        """One completion per entry of `prompt_ids`, at most `max_new_tokens` tokens each."""

    @abc.abstractmethod
    def update_weights(self, model_or_named) -> object:
        """Load the trainer's weights (a module or (name, tensor) pairs, HF names)."""

    def sleep(self) -> None:
        """Free engine memory between rollouts (no-op where unsupported)."""

    def wake_up(self) -> None:
        """Undo `sleep` (no-op where unsupported)."""

    def close(self) -> None:
        """Release the engine."""

    def generate(self, prompts: Sequence[Prompt], n: int = 1, sampling: Optional[SamplingConfig] = None
                 ) -> List[List[Completion]]:
        sampling = sampling or SamplingConfig()
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r}: expected an integer >= 1 (completions per prompt)")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError("prompts: expected a list of strings or of token-id lists")
        ids = [self._encode(p, i) for i, p in enumerate(prompts)]
        flat = [ids[i] for i in range(len(ids)) for _ in range(n)]
        seeds = [None if sampling.seed is None else sampling.seed + j for j in range(len(flat))]
        if sampling.thinking_budget is None:
            outs = self._sample(flat, sampling, sampling.max_new_tokens, seeds)
        else:
            outs = self._generate_with_budget(flat, sampling, seeds)
        groups: List[List[Completion]] = [[] for _ in prompts]
        for j, c in enumerate(outs):
            c.prompt_index = j // n
            groups[j // n].append(c)
        return groups

    def _encode(self, prompt: Prompt, index: int) -> List[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{index}] is a string but the engine has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompts[{index}] is empty: expected at least one token")
        return ids

    def _decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _generate_with_budget(self, flat: List[List[int]], sampling: SamplingConfig, seeds) -> List[Completion]:
        budget = sampling.thinking_budget
        first = self._sample(flat, sampling, budget, seeds)
        end_ids = self._encode(sampling.think_end, 0)
        interrupt = self._encode(sampling.interrupt, 0)
        cont_idx, cont_prompts, forced = [], [], []
        for j, c in enumerate(first):
            if c.finish_reason != "length":
                continue
            closed = _contains(c.token_ids, end_ids)
            extra = [] if closed else interrupt
            cont_idx.append(j)
            cont_prompts.append(flat[j] + c.token_ids + extra)
            forced.append(extra)
        if cont_idx:
            cont_seeds = [None if s is None else s + 7919 for s in (seeds[j] for j in cont_idx)]
            rest = self._sample(cont_prompts, sampling, sampling.answer_budget, cont_seeds)
            for j, extra, r in zip(cont_idx, forced, rest):
                c = first[j]
                c.token_ids = c.token_ids + extra + r.token_ids
                c.logprobs = c.logprobs + [0.0] * len(extra) + r.logprobs
                c.sampled_mask = c.sampled_mask + [0] * len(extra) + r.sampled_mask
                if c.token_versions is not None and r.token_versions is not None:  # forced tokens: the answer's first version
                    c.token_versions = c.token_versions + r.token_versions[:1] * len(extra) + r.token_versions
                c.finish_reason = r.finish_reason
                c.text = self._decode(c.token_ids)
        return first


def _contains(seq: Sequence[int], sub: Sequence[int]) -> bool:
    n = len(sub)
    return any(list(seq[i:i + n]) == list(sub) for i in range(len(seq) - n + 1))
