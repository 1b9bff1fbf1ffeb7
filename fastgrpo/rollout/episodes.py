"""Multi-turn, tool-using rollouts: episodes run turn by turn on any engine, many in flight.

`EpisodeRunner.run(problems, prompt_ids, n, sampling)` returns, like `RolloutEngine.generate`,
G `Completion`s per prompt: an episode flattened. Its `token_ids` are the ledger's ids after the
prompt (fastgrpo.episodes.ledger: sampled turns, environment answers, template bridges), its
`sampled_mask` the ledger's mask (1 only on sampled ids), its `logprobs` / `token_versions` the
sampling log-prob and policy version of every sampled id, its `text` the text of the final model
turn (what the rewards score: every single-turn reward works unchanged), and `episode` the
ledger. A turn samples on exactly the ids the ledger holds so far (the engine's `_sample`, or a
row of the continuous turn batcher).

A turn ends at the engine's eos or at `</tool_call>` (stop-at-tool-call). Then, in order: a
turn cut by its token cap ends the episode (`budget` when the per-episode budget is spent,
`length` when the engine's own cap was; no turn follows a truncated one); the turn's text is
parsed for tool calls and / or handed to the environment's `step`; no call and no environment
observation (or the environment says done) ends it (`done`); `rollout.max_turns` turns end it
(`max_turns`); environment ids that would not fit the budget end it (`budget`); an environment
whose reset / step times out or fails ends it (`tool_timeout` / `tool_error`); with
`rollout.tool_errors=stop` so does the first tool error, timeout or unparsable call. Otherwise
the tool results (an error or a timeout as text) go back to the model and the next turn starts.

Many in flight, two loops (`rollout.episode_batching`):

- continuous (auto's choice on the built-in engine with a Qwen2 / Qwen3 / Llama model:
  fastgrpo.rollout.continuous.TurnBatcher): every live episode's turn decodes in one running
  batch; a turn that ends leaves it at once and its tools start, an episode whose tools answered
  joins it again at the next admission, and each episode's keys / values are kept between its
  turns, so a later turn prefills only what the environment appended. The engine waits only when
  every live episode is in a tool; then the answers that arrive within one admission's time join
  the same admission (waiting at most what the admission it saves costs).
- groups (auto's choice elsewhere, e.g. vLLM, which schedules its own requests): the call's N
  episodes are dealt into `rollout.episode_groups` = k groups; the engine decodes one group's
  turn (one `_sample` call, re-prefilling the ledger) while the other groups' tools run. k = 1 is
  turn-synchronous batching (every episode decodes its turn, then every tool call runs, then the
  next turn), the loop of most peers.
- sync (benchmarks only): the continuous engine, turn-synchronous (the like-for-like baseline).

The bound is (d + t) / max(d, t) for a turn's decode d and a tool's latency t. Measured in
benchmarks/bench_tools.py (SmolLM2-135M float32, one thread; figures in its docstring and
docs/results.md), with a 1 s tool: where the episodes outnumber the engine's rows (32 on 16),
the continuous loop gave 1.62x / 1.49x the episodes/s of k = 1 (turns of 8 tokens / to a stop
string) and 1.21x / 1.13x the same engine run turn-synchronously: a row that leaves for its tool
goes to a waiting episode. In one batch that starts together (16 episodes on 256 rows) every
episode's own tool waits are on the critical path: 1.28x / 1.37x k = 1, all of it the kept caches.

Asynchronous workers: `hook` (the worker's in-flight hook) is polled between two turns (between
two decode steps in the continuous loop, whose running rows then keep or re-prefill their caches
as rollout.inflight says), so a weight swap may land mid-episode; every sampled id keeps the
version that sampled it.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from fastgrpo.episodes.calls import TOOL_CALL_END, format_tool_call, parse_tool_calls_ordered
from fastgrpo.episodes.ledger import Ledger
from fastgrpo.episodes.render import TurnRenderer, fork_prompt
from fastgrpo.rollout.base import Completion, SamplingConfig


@dataclass
class EpisodeSettings:
    max_turns: int = 4                   # model turns per episode
    max_tokens: int = 256                # per-episode budget: sampled + environment ids after the prompt
    history: str = "keep"                # keep | fork: a template that rewrites earlier turns (fastgrpo.episodes.render)
    groups: int = 1                      # episodes in flight: k groups, one decoding while the others' tools run
    tool_errors: str = "continue"        # continue (the error goes back as text) | stop (the episode ends)
    env_role: str = "user"               # role of an environment's observation message
    tool_role: str = "tool"              # role of a tool result message
    batching: str = "auto"               # auto | continuous | groups | sync (see the module docstring)


@dataclass
class _Episode:
    index: int                           # position in the call (problem index * n + sample)
    problem: object
    prompt: List[int]                    # ids the engine was prompted with at turn 1
    given: List[int] = field(default_factory=list)  # the caller's prompt ids (reset() may extend them)
    ledger: Ledger = field(default_factory=Ledger)
    used: int = 0                        # ids after the prompt so far (the budget's count)
    sample_start: List[int] = field(default_factory=lambda: [0])  # ledger segment where each sample starts
    history: List[dict] = field(default_factory=list)  # messages after the prompt (rollout.history=fork)
    env: object = None                   # EnvProcess, when rollout.env is set
    last_text: str = ""                  # text of the last model turn (the rewards' completion)
    pending: Optional[list] = None       # messages waiting to be rendered once the turn's tools answer

    def context(self) -> List[int]:
        return self.ledger.ids(self.sample_start[-1])


class EpisodeRunner:
    """Runs episodes on `engine` (its `_sample` primitive) with `tools` ({name: Tool}) run by
    `executor` (fastgrpo.episodes.executor.ToolExecutor) and / or an environment `env_spec`
    (fastgrpo.episodes.env.EnvSpec, one EnvProcess per episode)."""

    def __init__(self, engine, tokenizer, settings: EpisodeSettings, tools: Optional[dict] = None, executor=None,
                 env_spec=None, env_timeout: float = 30.0, hook: Optional[Callable[[], None]] = None,
                 native_tools: bool = True):
        self.engine, self.tok, self.s = engine, tokenizer, settings
        self.tools = dict(tools or {})
        self.executor = executor
        self.env_spec, self.env_timeout = env_spec, env_timeout
        self.hook = hook
        self.version: Optional[Callable[[], int]] = None  # an async worker's current policy version (tags each turn)
        # the schemas go to the template only where it renders them (else the prompts carry the
        # fallback system text: fastgrpo.episodes.calls.tools_system_prompt)
        env_tools = list(getattr(env_spec, "tools", None) or ())  # a TRL-style environment's methods (it runs them)
        schemas = ([t.schema for t in self.tools.values()] + env_tools or None) if native_tools else None
        self.renderer = TurnRenderer(tokenizer, tools=schemas)
        self._schemas = schemas
        self._calls_tools = bool(self.tools) or bool(env_tools)  # turns stop at </tool_call>
        end = tokenizer.convert_tokens_to_ids(TOOL_CALL_END) if self._calls_tools else None
        unk = getattr(tokenizer, "unk_token_id", None)
        # `</tool_call>` as one token: a stop id (checked on the id each step) instead of a stop
        # string (matched on the decoded text)
        self._stop_id = end if isinstance(end, int) and end >= 0 and end != unk else None
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="fastgrpo-env")
        self._n_threads = 8
        if settings.batching not in ("auto", "continuous", "groups", "sync"):
            raise ValueError(f"episode batching {settings.batching!r}: expected auto, continuous, groups or sync")
        if settings.batching in ("continuous", "sync") and self._continuous_engine() is None:
            self.close()
            raise ValueError(f"rollout.episode_batching={settings.batching}: the engine cannot batch turns "
                             "continuously (the built-in engine on a Qwen2 / Qwen3 / Llama model with decoder auto or "
                             "lean can); use auto or groups")

    def _continuous_engine(self):
        """The engine a TurnBatcher can run on (`inner`: under the benchmark's wrapper), else None."""
        from fastgrpo.rollout.continuous import TurnBatcher

        engine = getattr(self.engine, "inner", self.engine)
        return engine if TurnBatcher.supports(engine) else None

    def metrics(self) -> Dict[str, float]:
        """`episode/tool_leaks`: processes of finished tool calls still alive (0 unless a tool escaped
        the process-group kill; the executor's count, fastgrpo.episodes.executor)."""
        return {"episode/tool_leaks": float(self.executor.leaked())} if self.executor is not None else {}

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        if self.executor is not None:
            self.executor.close()

    # ------------------------------------------------------------------ the loop
    def run(self, problems: Sequence, prompt_ids: Sequence[Sequence[int]], n: int,
            sampling: SamplingConfig) -> List[List[Completion]]:
        eps = [_Episode(i * n + j, p, list(ids), list(ids)) for i, (p, ids) in enumerate(zip(problems, prompt_ids))
               for j in range(n)]
        for ep in eps:
            ep.ledger.append("prompt", ep.prompt, 0)
        try:
            if self.env_spec is not None:
                self._env_threads(len(eps))
                self._start_envs(eps)
            batcher = self._batcher(sampling)
            if batcher is None:
                self._loop(eps, sampling)
            else:
                try:
                    self._loop_continuous(eps, sampling, batcher)
                finally:
                    batcher.close()
        finally:
            for ep in eps:
                if ep.env is not None:
                    ep.env.close()
        groups: List[List[Completion]] = [[] for _ in problems]
        for ep in eps:
            groups[ep.index // n].append(self._flatten(ep))
        return groups

    def _loop(self, eps: List[_Episode], sampling: SamplingConfig) -> None:
        """Decode batches of `per` = ceil(N / k) episodes (N: the call's), each the first `per` back
        from their tools; while fewer are back, wait for more (k = 1: every live episode, i.e. the
        whole turn's tools), and when fewer are left, all of them. A batch waits for enough
        episodes, not for one particular one: with k > 1 a slow tool holds back its own episode,
        and a batch is never cut below `per` while more are coming (a call pays its decode
        steps once, however few rows it has)."""
        ready = [ep for ep in eps if ep.ledger.stop is None]
        per = max(1, math.ceil(len(ready) / max(1, self.s.groups)))
        waiting: Dict[concurrent.futures.Future, _Episode] = {}
        turn_sampling = self._turn_sampling(sampling)
        while ready or waiting:
            self._collect(waiting, ready, block=False)
            want = min(per, len(ready) + len(waiting))
            if ready and len(ready) >= want:
                batch, ready[:want] = ready[:want], []
                for ep, out in zip(batch, self._decode(batch, turn_sampling, sampling)):
                    fut = self._after_turn(ep, out)
                    if fut is not None:
                        waiting[fut] = ep
            elif waiting:
                self._collect(waiting, ready, block=True)
            if self.hook is not None:
                self.hook()  # an async worker may load staged weights here, between two turns

    def _batcher(self, sampling: SamplingConfig):
        """The engine's TurnBatcher (fastgrpo.rollout.continuous) where this run batches
        continuously, else None (the grouped loop)."""
        engine = None if self.s.batching == "groups" else self._continuous_engine()
        if engine is None:
            return None
        from fastgrpo.rollout.continuous import TurnBatcher

        return TurnBatcher(engine, self._turn_sampling(sampling), version=self.version,
                           turn_tokens=getattr(self.engine, "turn_tokens", None))

    def _loop_continuous(self, eps: List[_Episode], sampling: SamplingConfig, batcher) -> None:
        """Every live episode's turn in one running batch: a turn that ends leaves it and its tools
        start; an episode whose tools answered joins it again at the next admission (its kept
        cache serves the ledger so far). The engine waits only when every live episode is in a
        tool."""
        by_key = {ep.index: ep for ep in eps}
        waiting: Dict[concurrent.futures.Future, _Episode] = {}
        inflight = getattr(self.engine, "inflight", None)
        for ep in eps:
            if ep.ledger.stop is None:
                self._submit(batcher, ep, sampling)
        while batcher.busy or waiting:
            if waiting and (self.s.batching != "sync" or not batcher.busy):
                back: List[_Episode] = []
                self._collect(waiting, back, block=not batcher.busy)
                if (waiting and batcher.admit_s > 0 and not batcher.running()
                        and len(batcher.queue) + len(back) < batcher.room()):
                    # the engine is idle and the next admission has room: answers that arrive within
                    # one admission's time join it instead of costing one more admission (waiting
                    # at most what the admission it saves costs: ski rental)
                    self._collect(waiting, back, block=False, within=batcher.admit_s)
                while self.s.batching == "sync" and waiting:  # turn-synchronous: every episode's tools first
                    self._collect(waiting, back, block=True)
                for ep in back:
                    self._submit(batcher, ep, sampling)
            for key, out in self._step(batcher):
                ep = by_key[key]
                fut = self._after_turn(ep, out)
                if fut is not None:
                    waiting[fut] = ep
                else:
                    batcher.forget(key)
            if self.hook is not None and self.hook() is not None:  # new weights loaded between two steps
                batcher.weights_changed(getattr(inflight, "mode", "keep"))

    def _submit(self, batcher, ep: _Episode, sampling: SamplingConfig) -> None:
        seed = None if sampling.seed is None else sampling.seed + 7919 * ep.index + ep.ledger.turns
        batcher.submit(ep.index, ep.context(), self.s.max_tokens - ep.used, seed)

    def _step(self, batcher):
        """One step of the batcher (a method of its own: the benchmark times it)."""
        return batcher.step()

    def _collect(self, waiting: Dict[concurrent.futures.Future, _Episode], ready: List[_Episode], block: bool,
                 within: float = 0.0) -> None:
        """Move the episodes whose tools answered from `waiting` to the end of `ready` (those that go
        on; the others have ended). block: wait for at least one answer; within: wait up to this many
        seconds for all of them (those answered by then are taken)."""
        if not waiting:
            return
        done, _ = concurrent.futures.wait(
            list(waiting), timeout=within if within > 0 else (None if block else 0),
            return_when=concurrent.futures.ALL_COMPLETED if within > 0 else concurrent.futures.FIRST_COMPLETED)
        for fut in sorted(done, key=lambda f: waiting[f].index):
            ep = waiting.pop(fut)
            if self._answered(ep, fut.result()):
                ready.append(ep)

    def _env_threads(self, n: int) -> None:
        """Threads for `n` environment calls at once: every episode's step of a turn runs in
        parallel (k = 1 sends all of them together; each thread only waits on its process's pipe),
        not 8 at a time."""
        if n > self._n_threads:
            old, self._n_threads = self._threads, n
            self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastgrpo-env")
            old.shutdown(wait=True)

    def _turn_sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        if not self._calls_tools:
            return sampling
        if self._stop_id is not None:
            return dataclasses.replace(sampling, stop_token_ids=tuple(sampling.stop_token_ids) + (self._stop_id,))
        return dataclasses.replace(sampling, stop=tuple(sampling.stop) + (TOOL_CALL_END,))

    def _decode(self, batch: List[_Episode], turn_sampling: SamplingConfig, sampling: SamplingConfig):
        """One turn of every episode of `batch`, each capped at what its budget has left (the call's
        cap is the largest; a longer turn is cut to its episode's cap afterwards)."""
        caps = [self.s.max_tokens - ep.used for ep in batch]
        seeds = [None if sampling.seed is None else sampling.seed + 7919 * ep.index + ep.ledger.turns for ep in batch]
        outs = self.engine._sample([ep.context() for ep in batch], turn_sampling, max(caps), seeds)
        for out, cap in zip(outs, caps):
            if len(out.token_ids) > cap:
                out.token_ids, out.logprobs = out.token_ids[:cap], out.logprobs[:cap]
                out.sampled_mask = out.sampled_mask[:cap]
                if out.token_versions is not None:
                    out.token_versions = out.token_versions[:cap]
                out.finish_reason = "length"
        return outs

    def _after_turn(self, ep: _Episode, out: Completion) -> Optional[concurrent.futures.Future]:
        """Ledger the turn; end the episode or start what answers it (a Future), or None."""
        led = ep.ledger
        turn = led.turns + 1
        v = out.policy_version if out.policy_version is not None else (self.version() if self.version else None)
        versions = out.token_versions or ([v] * len(out.token_ids) if v is not None else None)
        led.append("sampled", out.token_ids, turn, logprobs=out.logprobs, versions=versions, text=out.text)
        ep.used += len(out.token_ids)
        ep.last_text = out.text
        ep.history.append({"role": "assistant", "content": out.text})
        if out.finish_reason == "length":  # no turn follows a truncated one
            led.end("budget" if ep.used >= self.s.max_tokens else "length")
            return None
        # parsed from the ids as sampled, special tokens kept (a tag may be one); never re-encoded
        parse_text = self.tok.decode(out.token_ids, skip_special_tokens=False) if self.tools or ep.env else ""
        items = parse_tool_calls_ordered(parse_text) if self.tools else []
        led.tool_calls += sum(1 for c in items if not isinstance(c, str))
        led.parse_errors += sum(1 for c in items if isinstance(c, str))
        if ep.env is not None:  # the environment answers every turn (its reward for the last one too)
            return self._threads.submit(self._env_step, ep, parse_text, items)
        if items and turn >= self.s.max_turns:
            led.end("max_turns")
            return None
        if not items:
            led.end("done")
            return None
        if self.s.tool_errors == "stop" and led.parse_errors:
            led.end("parse_error")
            return None
        return self.executor.submit(ep.index, items)

    def _env_step(self, ep: _Episode, text: str, items: list):
        """The environment's answer to a turn (run on a thread: the call itself is out of process)."""
        from fastgrpo.episodes.env import EnvFailure

        results = self.executor.run(ep.index, items) if items and self.executor is not None else []
        try:
            obs, reward, done = ep.env.step(text)
        except EnvFailure as e:
            return ("failed", e.status, str(e))
        return ("ok", results, (obs, reward, done))

    def _answered(self, ep: _Episode, answer) -> bool:
        """Append what answered the turn; True when the episode goes on to another turn."""
        led = ep.ledger
        if isinstance(answer, tuple):  # the environment's step
            if answer[0] == "failed":
                led.end("tool_timeout" if answer[1] == "timeout" else "tool_error")
                return False
            results, (obs, reward, done) = answer[1], answer[2]
            if reward is not None:
                led.env_reward = (led.env_reward or 0.0) + float(reward)
                led.turn_rewards.append((len(led.ids(1)) - 1, float(reward)))
            msgs = self._tool_messages(ep, results)
            if obs:
                msgs.append({"role": self.s.env_role, "content": str(obs)})
            if done or not msgs:
                led.end("done")
                return False
            if led.turns >= self.s.max_turns:
                led.end("max_turns")
                return False
        else:
            msgs = self._tool_messages(ep, answer)
        if self.s.tool_errors == "stop" and (led.tool_errors or led.tool_timeouts):
            led.end("tool_timeout" if led.tool_timeouts else "tool_error")
            return False
        return self._extend(ep, msgs)

    def _tool_messages(self, ep: _Episode, results) -> List[dict]:
        led = ep.ledger
        msgs = []
        for r in results:
            led.tool_errors += r.status == "error"
            led.tool_timeouts += r.status == "timeout"
            msgs.append({"role": self.s.tool_role, "name": r.name, "content": r.output})
        return msgs

    def _extend(self, ep: _Episode, msgs: List[dict]) -> bool:
        """Close the model's turn, render the environment's messages and the next header into the
        ledger, within the budget; or fork a new sample (rollout.history=fork)."""
        led = ep.ledger
        turn = led.turns
        close = self.renderer.close(led.segments[-1].ids)
        (env_text, env_ids), (head_text, head_ids) = self.renderer.environment(msgs)
        if ep.used + len(close) + len(env_ids) + len(head_ids) >= self.s.max_tokens:
            led.end("budget")  # no room for the answer and at least one sampled token
            return False
        ep.history += msgs
        if close:
            led.append("bridge", close, turn, text=self.tok.decode(close, skip_special_tokens=False))
        led.append("environment", env_ids, turn, text=env_text)
        if head_ids:
            led.append("bridge", head_ids, turn, text=head_text)
        ep.used += len(close) + len(env_ids) + len(head_ids)
        if self.s.history == "fork" and self.renderer.template:
            self._maybe_fork(ep)
        return True

    def _maybe_fork(self, ep: _Episode) -> None:
        """rollout.history=fork: when the template's rendering of the history differs from the
        ledger, the next turn starts a new sample prompted with the template's rendering."""
        text = fork_prompt(self.tok, ep.problem.prompt, ep.history, self._schemas)
        # compared as text: the ledger's ids are the sampled split, which re-encoding would not give back
        if text != self.tok.decode(ep.context(), skip_special_tokens=False):
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            ep.ledger.append("prompt", ids, ep.ledger.turns, text=text)
            ep.sample_start.append(len(ep.ledger.segments) - 1)

    def _start_envs(self, eps: List[_Episode]) -> None:
        from fastgrpo.episodes.env import EnvFailure, EnvProcess

        for ep in eps:
            ep.env = EnvProcess(self.env_spec, timeout=self.env_timeout)
        futs = {self._threads.submit(ep.env.reset, dict(getattr(ep.problem, "row", {}) or {})): ep for ep in eps}
        for fut, ep in futs.items():
            try:
                obs = fut.result()
            except EnvFailure as e:
                ep.ledger.end("tool_timeout" if e.status == "timeout" else "tool_error")
                continue
            if obs:
                self._first_observation(ep, str(obs))

    def _first_observation(self, ep: _Episode, obs: str) -> None:
        """reset()'s observation: a message after the task's prompt, before the first turn; the
        episode's prompt becomes the template's rendering of both (a prompt segment of its own)."""
        msg = {"role": self.s.env_role, "content": obs}
        if self.renderer.template:
            text = fork_prompt(self.tok, ep.problem.prompt, [msg], self._schemas)
        else:
            text = ep.problem.prompt + f"\n{obs}\n"
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        ep.ledger.segments[0].ids = ids  # the episode has not started: its prompt is set, not rewritten
        ep.prompt = ids

    # ------------------------------------------------------------------ flatten
    def _flatten(self, ep: _Episode) -> Completion:
        """The episode as the trainer's Completion (its first sample), later samples (forks) in
        `forks`, each a Completion with its own `prompt_ids`."""
        led = ep.ledger
        if led.stop is None:  # every path above ends the episode; a bug if not
            raise RuntimeError(f"episode {ep.index} did not end")
        led.check()
        starts = ep.sample_start + [len(led.segments)]
        slots = self._turn_slots(led)
        samples = []
        for a, b in zip(starts, starts[1:]):
            seg = led.segments[a:b]
            while seg and seg[-1].kind != "sampled":  # trailing environment ids train nothing
                seg = seg[:-1]
            sub = Ledger(segments=seg)
            n = sum(len(s.ids) for s in seg[1:])
            samples.append((seg[0].ids, sub, None if slots is None else slots[a + 1][:n]))
        (prompt, first, first_slots), forks = samples[0], samples[1:]
        # the caller's own prompt: None, so a trainer packs its cached ids (and may share them in a group)
        c = self._completion(first, ep, None if prompt == ep.given else prompt, first_slots)
        c.forks = [self._completion(s, ep, p, sl) for p, s, sl in forks]
        c.episode = led
        return c

    @staticmethod
    def _turn_slots(led: Ledger):
        """None without per-turn rewards; else {segment k: the turn reward each id from segment k on
        belongs to} — the first reward at or after the id (the turn that earned it and the turns
        without a reward before it), -1 on ids that are not sampled or come after the last reward
        (rollout.turn_rewards=dense reads them: fastgrpo.rewards.process.attach_turn_advantages)."""
        import numpy as np

        if not led.turn_rewards:
            return None
        ends = np.array([e for e, _ in led.turn_rewards], dtype=np.int64)  # positions in ids(1)
        mask = np.array(led.mask(1), dtype=bool)
        slot = np.searchsorted(ends, np.arange(len(mask)), side="left")
        slot = np.where(mask & (slot < len(ends)), slot, -1).astype(np.int32)
        out, pos = {}, 0
        for k in range(1, len(led.segments) + 1):
            out[k] = slot[pos:]
            if k < len(led.segments):
                pos += len(led.segments[k].ids)
        return out

    def _completion(self, sub: Ledger, ep: _Episode, prompt: List[int], turn_slots=None) -> Completion:
        ids, mask, lps, vers = sub.ids(1), sub.mask(1), sub.logprobs(1), sub.versions(1)
        finish = "length" if ep.ledger.stop in ("length", "budget") else "stop"
        c = Completion(ids, lps, finish, text=ep.last_text, sampled_mask=mask,
                       policy_version=vers[0] if vers else None, token_versions=vers)
        c.prompt_ids = prompt
        if turn_slots is not None:
            c.turn_slots = turn_slots  # [len(ids)]: the per-turn reward of each id (-1: none)
        return c
