"""Difficulty filtering and curriculum for RLVR prompt selection.

- per-prompt pass-rate tracking: success counts and an EMA of each group's pass rate;
- offline difficulty filter: keep prompts whose pass rate over G samples lies in [0.2, 0.8]
  (Skywork-OR1 / Polaris style); the Kimi K1.5 / Qwen3 variant drops prompts the base model
  already solves at best-of-8;
- online dynamic sampling (DAPO, Yu et al. 2025 §3.2): drop groups whose rewards are all equal
  (zero advantage, zero gradient) and generate more until the batch is full, with bounded tries;
- sampling weights ∝ (1 − pass rate) (Qwen3-style hard-prompt emphasis) with a floor so no
  active prompt starves, and pruning of prompts whose pass rate rises above 0.9;
- a pass-rate histogram metric and JSON-serializable state for checkpoints.
Departures: a prompt never seen uses a prior pass rate (0.5) for its weight, and pruning waits
for `min_attempts` samples so one lucky group cannot retire a prompt.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence

import numpy as np


def _rng(rng) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if rng is None or isinstance(rng, (int, np.integer)):
        return np.random.default_rng(rng)
    if isinstance(rng, random.Random):
        return np.random.default_rng(rng.getrandbits(63))
    raise ValueError(f"rng={rng!r}: expected a numpy Generator, a random.Random, an int seed or None")


def _pass_rate(rewards: Sequence[float], success_threshold: float) -> float:
    vals = [r for r in rewards if r is not None]
    if not vals:
        raise ValueError("rewards: expected at least one non-None reward per prompt")
    return sum(r >= success_threshold for r in vals) / len(vals)


def filter_by_pass_rate(rewards_by_prompt: Mapping[Hashable, Sequence[float]], low: float = 0.2, high: float = 0.8,
                        success_threshold: float = 1.0) -> List[Hashable]:
    """Offline filter: prompt ids whose pass rate over their G sampled rewards is in [low, high]."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"low={low!r}, high={high!r}: expected 0 ≤ low ≤ high ≤ 1")
    return [pid for pid, rs in rewards_by_prompt.items() if low <= _pass_rate(rs, success_threshold) <= high]


def filter_best_of_n(rewards_by_prompt: Mapping[Hashable, Sequence[float]], n: int = 8,
                     success_threshold: float = 1.0) -> List[Hashable]:
    """Kimi K1.5 / Qwen3 variant: drop prompts the base model solves at best-of-n (any of the
    first n samples succeeds); keeps the ones it never solves in n tries."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: expected a positive int")
    keep = []
    for pid, rs in rewards_by_prompt.items():
        first = [r for r in list(rs)[:n] if r is not None]
        if len(first) < n:
            raise ValueError(f"rewards_by_prompt[{pid!r}]: expected at least n={n} rewards, got {len(first)}")
        if not any(r >= success_threshold for r in first):
            keep.append(pid)
    return keep


@dataclass
class DynamicSamplingResult:
    rounds: List[Any]  # what each call of `generate` returned, in order
    tries: int  # calls made to `generate`
    kept: int  # informative groups over all rounds (over all ranks when `agree` sums them)
    seen: int  # groups generated over all rounds (idem)
    full: bool  # whether the batch reached num_groups

    def metrics(self) -> Dict[str, float]:
        return {"curriculum/dynamic_tries": float(self.tries),
                "curriculum/dynamic_drop_frac": 1.0 - self.kept / self.seen if self.seen else 0.0,
                "curriculum/dynamic_full": float(self.full)}


def informative(rewards: Sequence[Optional[float]], atol: float = 1e-9) -> bool:
    """Whether a group's rewards differ (σ > 0 within atol): a group of equal rewards has zero
    advantages and teaches nothing. None rewards (unverifiable) are ignored."""
    rs = [float(r) for r in rewards if r is not None]
    return len(rs) >= 2 and max(rs) - min(rs) > atol


def dynamic_sampling(generate: Callable[[int], Any], num_groups: int, *, kept_of: Callable[[Any], int],
                     size_of: Callable[[Any], int] = len, max_tries: int = 4, oversample: float = 1.0,
                     agree: Callable[[int], int] = int) -> DynamicSamplingResult:
    """DAPO dynamic sampling: call `generate(k)` for k new groups until `num_groups` informative
    groups are in hand, at most `max_tries` calls. The trainer's step and any caller share it.

    `generate(k)` returns one round (any object: the trainer's holds prompts, rollouts, rewards and
    a keep mask); `kept_of(round)` counts its groups worth training on, `size_of(round)` all of its
    groups. `agree(n)` turns this process's count into the count every data-parallel rank uses (a
    sum all-reduce), so that all ranks take the same number of rounds; k is then what is missing
    over all ranks. `oversample` asks for more than missing (e.g. 1.5 when ~1/3 are dropped).
    Returns every round, kept or not, even when not full: the caller decides what to train on
    (the trainer trains on the kept groups and logs metrics over all of them)."""
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups={num_groups!r}: expected a positive int")
    if not isinstance(max_tries, int) or max_tries < 1:
        raise ValueError(f"max_tries={max_tries!r}: expected a positive int")
    if not oversample >= 1.0:
        raise ValueError(f"oversample={oversample!r}: expected ≥ 1.0")
    rounds: List[Any] = []
    kept = seen = 0
    while len(rounds) < max_tries:
        total = int(agree(kept)) if rounds else 0
        if total >= num_groups:
            break
        r = generate(max(int(math.ceil((num_groups - total) * oversample)), 1))
        rounds.append(r)
        kept += int(kept_of(r))
        seen += int(size_of(r))
    total, seen_all = int(agree(kept)), int(agree(seen))
    return DynamicSamplingResult(rounds, len(rounds), total, seen_all, total >= num_groups)


@dataclass
class _Stats:
    attempts: int = 0
    successes: int = 0
    ema: Optional[float] = None
    pruned: bool = False


@dataclass
class Curriculum:
    """Pass-rate-aware prompt sampler. The trainer calls `sample(batch_size, rng)` for prompt
    ids and `update(prompt_ids, rewards)` after scoring (one id per reward, repeated G times)."""

    prompt_ids: Sequence[Hashable]  # every prompt id of the dataset (ints or strings)
    weighting: str = "inverse_pass"  # "inverse_pass" (∝ 1 − pass rate, Qwen3) or "uniform"
    ema_decay: float = 0.9  # ema ← decay·ema + (1 − decay)·group pass rate
    prior: float = 0.5  # pass rate assumed for prompts not seen yet
    min_weight: float = 0.05  # weight floor so a nearly solved prompt can still be drawn
    prune_above: Optional[float] = 0.9  # retire prompts whose pass rate exceeds this (None: never)
    min_attempts: int = 8  # samples needed before a prompt can be pruned
    success_threshold: float = 1.0  # reward ≥ this counts as a pass
    _stats: Dict[Hashable, _Stats] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        ids = list(self.prompt_ids)
        if not ids:
            raise ValueError("prompt_ids: expected at least one prompt id")
        if len(set(ids)) != len(ids):
            raise ValueError("prompt_ids: expected unique ids")
        if self.weighting not in ("inverse_pass", "uniform"):
            raise ValueError(f"weighting={self.weighting!r}: expected 'inverse_pass' or 'uniform'")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay!r}: expected a float in [0, 1)")
        if not 0.0 < self.min_weight <= 1.0:
            raise ValueError(f"min_weight={self.min_weight!r}: expected a float in (0, 1]")
        self.prompt_ids = ids
        self._stats = {pid: _Stats() for pid in ids}
        self._hist_names: Dict[tuple, tuple] = {}  # (bin edges, metric names) per (bins, prefix)
        self._rebuild()

    def pass_rate(self, pid: Hashable) -> float:
        """EMA pass rate of a prompt (the prior before its first update)."""
        s = self._stats[pid]
        return self.prior if s.ema is None else s.ema

    def update(self, prompt_ids: Sequence[Hashable], rewards: Sequence[Optional[float]]) -> None:
        """Record one batch of scored samples; None rewards (data errors) are skipped."""
        if len(prompt_ids) != len(rewards):
            raise ValueError(f"rewards: expected one per prompt id ({len(prompt_ids)}), got {len(rewards)}")
        groups: Dict[Hashable, List[float]] = {}
        for pid, r in zip(prompt_ids, rewards):
            if pid not in self._stats:
                raise ValueError(f"prompt_ids: unknown id {pid!r}")
            if r is not None:
                groups.setdefault(pid, []).append(float(r))
        for pid, rs in groups.items():
            s = self._stats[pid]
            wins = sum(r >= self.success_threshold for r in rs)
            s.attempts += len(rs)
            s.successes += wins
            rate = wins / len(rs)
            s.ema = rate if s.ema is None else self.ema_decay * s.ema + (1 - self.ema_decay) * rate
            if self.prune_above is not None and s.attempts >= self.min_attempts and s.ema > self.prune_above:
                s.pruned = True
        self._dirty.update(groups)

    # The trainer samples and logs the histogram every step; recomputing weights, active ids and
    # pass rates from the per-prompt stats each time walked every prompt of the dataset (2300 on
    # the demo task: ~0.3 ms a step on a busy CPU). These arrays, aligned with `prompt_ids`, are
    # derived from `_stats`: `update` only notes the prompts it touched, and the next read
    # refreshes those entries in one vectorised pass. They hold the float64 values the full
    # recomputation gives (the same elementwise operations), so the draws are unchanged.
    def _rebuild(self) -> None:
        n = len(self.prompt_ids)
        self._pos = {pid: k for k, pid in enumerate(self.prompt_ids)}
        self._raw = np.empty(n, dtype=np.float64)  # max(1 − pass rate, min_weight)
        self._ema = np.zeros(n, dtype=np.float64)
        self._seen = np.zeros(n, dtype=bool)
        self._pruned = np.zeros(n, dtype=bool)
        self._key = (self.prior, self.min_weight)
        self._active = None
        self._dirty = set()
        self._write(list(self.prompt_ids))

    def _write(self, pids: List[Hashable]) -> None:
        if not pids:
            return
        stats = [self._stats[p] for p in pids]
        k = np.fromiter((self._pos[p] for p in pids), dtype=np.int64, count=len(pids))
        seen = np.fromiter((s.ema is not None for s in stats), dtype=bool, count=len(pids))
        ema = np.fromiter((self.prior if s.ema is None else s.ema for s in stats), dtype=np.float64, count=len(pids))
        self._raw[k] = np.maximum(1.0 - ema, self.min_weight)
        self._ema[k] = np.where(seen, ema, 0.0)
        self._seen[k] = seen
        pruned = np.fromiter((s.pruned for s in stats), dtype=bool, count=len(pids))
        if (self._pruned[k] != pruned).any():
            self._pruned[k] = pruned
            self._active = None  # the active list changes only when a prompt is retired

    def _active_index(self):
        """(active ids, their positions in `prompt_ids`), with the arrays brought up to date."""
        if self._key != (self.prior, self.min_weight):
            self._rebuild()  # prior / min_weight changed: every weight moves
        elif self._dirty:
            self._write(list(self._dirty))
            self._dirty = set()
        if self._active is None:
            idx = np.flatnonzero(~self._pruned)
            self._active = ([self.prompt_ids[k] for k in idx.tolist()], idx)
        return self._active

    def active_ids(self) -> List[Hashable]:
        return list(self._active_index()[0])

    def weights(self, ids: Optional[Sequence[Hashable]] = None) -> np.ndarray:
        if ids is None:
            ids, idx = self._active_index()
        else:
            self._active_index()  # brings the arrays up to date
            idx = np.fromiter((self._pos[p] for p in ids), dtype=np.int64, count=len(ids))
        if self.weighting == "uniform":
            w = np.ones(len(ids))
        else:
            w = self._raw[idx]
        return w / w.sum() if len(ids) else w

    def sample(self, batch_size: int, rng=None) -> List[Hashable]:
        """`batch_size` prompt ids among the active ones, drawn ∝ weights; without replacement
        when enough prompts are active, with replacement otherwise."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: expected a positive int")
        ids = self._active_index()[0]
        if not ids:
            raise ValueError("Curriculum.sample: every prompt is pruned (pass rate > prune_above); "
                             "raise prune_above or add prompts")
        g = _rng(rng)
        idx = g.choice(len(ids), size=batch_size, replace=batch_size > len(ids), p=self.weights())
        return [ids[i] for i in idx.tolist()]

    def histogram(self, bins: int = 10, prefix: str = "curriculum") -> Dict[str, float]:
        """Metrics: share of seen prompts per pass-rate bin, plus seen / pruned fractions."""
        self._active_index()  # brings the arrays up to date
        seen = self._ema[self._seen]  # in prompt order, as the stats are
        cached = self._hist_names.get((bins, prefix))
        if cached is None:
            edges = np.histogram_bin_edges([], bins=bins, range=(0.0, 1.0))
            cached = self._hist_names[(bins, prefix)] = (
                edges, [f"{prefix}/pass_rate_hist/{edges[i]:.1f}-{edges[i + 1]:.1f}" for i in range(bins)])
        edges, names = cached
        # np.histogram's counts (edges[k] <= x < edges[k+1], the last bin closed, values outside
        # [0, 1] left out) without its per-call overhead (~4x the cost of these four ops)
        k = np.searchsorted(edges, seen[(seen >= 0.0) & (seen <= 1.0)], side="right") - 1
        k[k == bins] = bins - 1
        hist = np.bincount(k, minlength=bins).tolist()
        n_seen, n = int(seen.size), len(self._stats)
        out = {name: (h / n_seen if n_seen else 0.0) for name, h in zip(names, hist)}
        out[f"{prefix}/seen_frac"] = n_seen / n
        out[f"{prefix}/pruned_frac"] = int(np.count_nonzero(self._pruned)) / n
        out[f"{prefix}/pass_rate_mean"] = float(np.mean(seen)) if n_seen else 0.0
        return out

    def state_dict(self) -> Dict[str, Any]:
        """JSON-serializable state (ids kept in a list, so int ids stay ints)."""
        return {"ids": list(self.prompt_ids),
                "stats": [[s.attempts, s.successes, s.ema, s.pruned] for s in (self._stats[p] for p in self.prompt_ids)]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ids, stats = list(state["ids"]), state["stats"]
        if ids != list(self.prompt_ids):
            raise ValueError("state['ids']: the checkpoint's prompt ids differ from this curriculum's")
        self._stats = {pid: _Stats(int(a), int(w), None if e is None else float(e), bool(p))
                       for pid, (a, w, e, p) in zip(ids, stats)}
        self._rebuild()
