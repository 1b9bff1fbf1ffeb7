"""The episode ledger: an append-only list of segments, the one record of a multi-turn episode.

A segment is `prompt` (the task's prompt ids, as the trainer tokenized them), `sampled` (the ids
one model turn produced, exactly as the engine returned them, with the sampling log-prob and the
policy version of each), `environment` (a tool's or an environment's answer, rendered through
the chat template against a fixed base: fastgrpo.episodes.render) or `bridge` (the template's
glue between two turns: the end-of-turn token the model did not sample because its turn stopped
at a tool call, the newline after it, the next assistant header). The trainer packs exactly the
ledger's ids; `mask()` is 1 on sampled tokens and 0 everywhere else, the only mask every loss
path sees (it becomes `Completion.sampled_mask`).

The invariant, checked by `check()` and by the tests: the ids are the concatenation of the
segments in the order they were appended (nothing is ever rewritten or re-encoded); a sampled
segment carries one log-prob and one version per id; non-sampled segments carry none.

Departure from the peers (TRL, verl, SkyRL, prime-rl; their issue trackers, read 2026-12-04):
they decode each turn and re-tokenize the conversation, so the trained ids can differ from the
sampled ones at turn boundaries; here the sampled ids are kept and the template is only ever
rendered for what the environment adds. A template that rewrites history (Qwen3 drops earlier
`<think>` blocks) is a documented choice (`rollout.history`), never a silent realignment:
`keep` trains on the ledger as sampled, `fork` starts a new sample whose prompt is the
template's re-rendering of the history (see fastgrpo.rollout.episodes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

KINDS = ("prompt", "sampled", "environment", "bridge")

# why an episode ended; the order is the table of README's "Multi-turn tools" section
STOP_REASONS = ("done", "max_turns", "budget", "length", "tool_timeout", "tool_error", "parse_error")


@dataclass
class Segment:
    kind: str                                   # one of KINDS
    ids: List[int]                              # token ids, as sampled (sampled) or as rendered (the rest)
    turn: int                                   # model turn it belongs to (0 = the prompt)
    logprobs: Optional[List[float]] = None      # sampled only: log-prob of each id under the sampling policy
    versions: Optional[List[int]] = None        # sampled only: the policy version that sampled each id
    text: str = ""                              # for people (samples.jsonl); never turned back into ids


@dataclass
class Ledger:
    """One episode, segment by segment. `stop` says why it ended (STOP_REASONS)."""

    segments: List[Segment] = field(default_factory=list)
    stop: Optional[str] = None                  # set once, when the episode ends
    tool_calls: int = 0                         # tool calls the model made
    tool_errors: int = 0                        # calls that came back as an error (bad tool, bad args, raised)
    tool_timeouts: int = 0                      # calls stopped at rollout.tool_timeout
    parse_errors: int = 0                       # tool-call tags that did not parse
    env_reward: Optional[float] = None          # the environment's reward (sum of its step rewards), if it gave any
    turn_rewards: List[tuple] = field(default_factory=list)  # (index of the turn's last token in ids, reward)

    def append(self, kind: str, ids, turn: int, logprobs=None, versions=None, text: str = "") -> Segment:
        if self.stop is not None:
            raise RuntimeError(f"episode ledger: append({kind!r}) after the episode ended ({self.stop})")
        if kind not in KINDS:
            raise ValueError(f"segment kind {kind!r}: expected one of {KINDS}")
        ids = [int(t) for t in ids]
        if kind == "sampled":
            if logprobs is None or len(logprobs) != len(ids):
                raise ValueError(f"sampled segment of turn {turn}: {len(ids)} ids but "
                                 f"{None if logprobs is None else len(logprobs)} log-probs")
            if versions is not None and len(versions) != len(ids):
                raise ValueError(f"sampled segment of turn {turn}: {len(ids)} ids but {len(versions)} versions")
        elif logprobs is not None or versions is not None:
            raise ValueError(f"{kind} segment of turn {turn}: only sampled tokens carry log-probs and versions")
        seg = Segment(kind, ids, turn, None if logprobs is None else [float(x) for x in logprobs],
                      None if versions is None else [int(v) for v in versions], text)
        self.segments.append(seg)
        return seg

    def end(self, reason: str) -> None:
        if reason not in STOP_REASONS:
            raise ValueError(f"stop reason {reason!r}: expected one of {STOP_REASONS}")
        if self.stop is None:
            self.stop = reason

    # ------------------------------------------------------------------ views
    def ids(self, start: int = 0) -> List[int]:
        """Every id from segment `start` on, in order."""
        return [t for s in self.segments[start:] for t in s.ids]

    def mask(self, start: int = 0) -> List[int]:
        """1 on sampled ids, 0 on the rest: the mask of every loss path."""
        return [int(s.kind == "sampled") for s in self.segments[start:] for _ in s.ids]

    def logprobs(self, start: int = 0) -> List[float]:
        """Sampling log-probs of the sampled ids, 0.0 elsewhere (masked out: never used)."""
        return [lp for s in self.segments[start:] for lp in (s.logprobs if s.kind == "sampled" else [0.0] * len(s.ids))]

    def versions(self, start: int = 0) -> Optional[List[int]]:
        """Per id, the version of the policy that sampled it; a non-sampled id carries the version of
        the next sampled one (the policy that read it), the last one at the end. None when no
        sampled segment has versions (colocated runs)."""
        segs = self.segments[start:]
        if not any(s.versions for s in segs if s.kind == "sampled"):
            return None
        out: List[Optional[int]] = []
        for s in segs:
            out += list(s.versions) if s.kind == "sampled" and s.versions else [None] * len(s.ids)
        nxt = next((v for v in reversed(out) if v is not None), 0)
        for i in range(len(out) - 1, -1, -1):
            nxt = out[i] = out[i] if out[i] is not None else nxt
        return out  # type: ignore[return-value]

    def sampled(self) -> List[Segment]:
        return [s for s in self.segments if s.kind == "sampled"]

    @property
    def turns(self) -> int:
        return len(self.sampled())

    def check(self) -> None:
        """The invariant: kinds known, sampled segments carry one log-prob (and version) per id,
        the others none. Raises AssertionError naming the segment (a bug of ours, not user input)."""
        for i, s in enumerate(self.segments):
            assert s.kind in KINDS, f"segment {i}: kind {s.kind!r}"
            if s.kind == "sampled":
                assert s.logprobs is not None and len(s.logprobs) == len(s.ids), f"segment {i}: log-probs"
                assert s.versions is None or len(s.versions) == len(s.ids), f"segment {i}: versions"
            else:
                assert s.logprobs is None and s.versions is None, f"segment {i}: {s.kind} with log-probs"

    def counters(self) -> Dict[str, float]:
        return {"turns": float(self.turns), "tool_calls": float(self.tool_calls),
                "tool_errors": float(self.tool_errors), "tool_timeouts": float(self.tool_timeouts),
                "parse_errors": float(self.parse_errors)}

    def transcript(self) -> List[dict]:
        """The episode turn by turn for samples.jsonl: [{"turn", "kind", "text"}] of every
        segment after the prompt (sampled vs environment text)."""
        return [{"turn": s.turn, "kind": s.kind, "text": s.text} for s in self.segments if s.kind != "prompt"]
