"""fastgrpo.rewards: verifiable rewards that survive hostile model output.

Public API (batch in, floats out, same order; `return_reasons=True` adds reason codes):

    math_reward(completions, answers, **opts) -> list[float | None]
    code_reward(completions, tests, timeout=5.0, **opts) -> list[float | None]
    format_reward(completions, **opts) -> list[float]
    kimi_length_reward(lengths, correct, **opts) -> list[float]
    overlong_penalty(lengths, max_length, cache_length) -> list[float]
    language_reward(completions, language="en", **opts) -> list[float]
    combine_rewards({name: scores}, {name: weight}) -> CombinedReward

math and code run in a persistent RewardPool (worker processes, hard per-item timeouts). A
trainer creates one `RewardManager` (or a `RewardPool` passed as `pool=`) and closes it at the
end; without `pool=`, a process-wide default pool is created on first use and closed at exit.
"""
from fastgrpo.rewards import reasons
from fastgrpo.rewards.code import code_reward, extract_code
from fastgrpo.rewards.combine import CombinedReward, RewardManager, combine_rewards
from fastgrpo.rewards.format import format_reward
from fastgrpo.rewards.language import language_reward
from fastgrpo.rewards.length import KimiLengthGate, kimi_length_reward, overlong_penalty
from fastgrpo.rewards.math import extract_answer, math_reward
from fastgrpo.rewards.sandbox.pool import RewardPool, TaskResult, default_pool
from fastgrpo.rewards.sandbox.runner import SandboxLimits, isolation_level

__all__ = [
    "math_reward", "code_reward", "format_reward", "kimi_length_reward", "language_reward", "combine_rewards",
    "overlong_penalty", "KimiLengthGate", "CombinedReward", "RewardManager", "RewardPool", "TaskResult",
    "default_pool", "SandboxLimits", "isolation_level", "extract_answer", "extract_code", "reasons",
]
