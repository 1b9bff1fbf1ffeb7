"""The asynchronous schedule's orchestrator (trainer rank 0): admission by staleness, the
version-tagged buffer, dispatch to rollout workers, fault recovery, its own checkpoint state.

Admission follows AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System", §5 staleness-aware training): a prompt is started only when it cannot arrive
more than η = rollout.max_staleness versions stale; samples are never dropped to enforce it.
AReaL admits while `admitted < (version + η + 1) · B`; we count what the trainer really took
instead of `version · B` — `admitted < C(version) + (η + 1) · B`, C(v) = prompts consumed when
version v was published — because dynamic sampling and extra rounds consume more than B
prompts a step, and the trainer's own demand of the moment is always admitted (sampled at the
current version, those are fresh). The trainer takes the oldest groups first and must take every
group whose deadline is this step (admitted at a version ≤ v − η), and a group of a newer
admission version never overtakes an unreturned one of an older version (stragglers are overtaken
only inside their own version); with each step consuming at least B prompts the deadline set
then never exceeds B, so staleness (the version being trained minus the version that sampled it)
never exceeds η.

Deterministic mode (rollout.deterministic, for tests) puts this schedule on a logical clock:
one prompt per call with its own seed, every call admitted under version v finishes before
version v + 1 is broadcast (swaps at fixed points), and the trainer takes groups in admission
order — two runs with one seed train on the same groups in the same order.

Faults: a worker that dies is restarted, the group re-formed, the current weights broadcast, and
every prompt it held is resubmitted (same admission index and seed). Deterministic mode keeps its
promise across a worker's death: a prompt is resubmitted under the weights of the version it was
admitted at — the orchestrator keeps that version's weights (a CPU copy, taken before the
trainer's update when calls admitted under it still run, dropped at the sync) — so a run whose
worker died trains the same groups, metrics and weights as one whose worker did not. The state
saved with a checkpoint holds the buffered groups with their versions and the admitted-but-
unreturned prompts, so a resumed run trains every admitted prompt exactly once.
"""
from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from fastgrpo.rollout.base import Completion
from fastgrpo.workers.pool import WorkerDied, WorkerError, WorkerPool


@dataclass
class Admitted:
    index: int                 # admission order (0, 1, …) over the whole run
    problem: object            # the task's problem (`.id`, `.prompt`)
    admit_version: int         # trainer weights version when it was admitted
    seed: Optional[int]        # its sampling seed (deterministic mode), else None
    groups: Optional[List[Completion]] = None  # its G completions once returned


class Orchestrator:
    def __init__(self, cfg, sample: Callable[[int], list], prompt_ids: Callable[[list], List[List[int]]],
                 problems_by_id: Dict, weights: Callable[..., list], sampling, pool: WorkerPool, log=print):
        r = cfg.rollout
        self.cfg, self.log = cfg, log
        self.B, self.G, self.eta = r.prompts_per_step, r.group_size, r.max_staleness
        self.det = r.deterministic
        self.chunk = 1 if self.det else (r.prompts_per_call or max(1, math.ceil(self.B / r.workers)))
        self.sample, self.prompt_ids, self.by_id, self.weights = sample, prompt_ids, problems_by_id, weights
        self.sampling = sampling
        self.pool = pool
        self.timeout = float(cfg.sync.timeout)
        self.version = 0           # the version of the weights the workers hold (= trainer syncs so far)
        self.admitted = 0          # prompts admitted so far (next admission index)
        self.consumed = 0          # prompts handed to the trainer so far
        self.consumed_at_version = 0  # C(version)
        self.items: Dict[int, Admitted] = {}  # admitted, not yet consumed (running, queued or buffered)
        self.queue: List[int] = []  # admitted, to be (re)submitted
        self.calls: Dict = {}       # ObjectRef → (worker, [indices])
        self.outstanding = [0] * self.pool.n
        self._call_seq = 0
        self._idle = [0.0] * self.pool.n  # each worker's reported idle seconds (cumulative, this process)
        self._idle_seen = 0.0
        self.wait_trainer = 0.0     # seconds the trainer waited for groups (cumulative, reset by metrics())
        self.sync_s = 0.0
        self._syncing = False
        self._held = None  # deterministic: (version, [(name, CPU copy, device)]) of the weights its calls run under
        self.started = False
        # sync.overlap: the broadcast of a sync runs on this thread while the trainer goes on; the
        # trainer joins it before its weights change again (join()). Deterministic mode keeps the
        # broadcast in line (its swaps are fixed points of the schedule).
        self.overlap = bool(cfg.sync.overlap) and not self.det
        self._bcast = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastgrpo-broadcast") if self.overlap else None
        self._inflight = None  # the future of the broadcast in flight
        self.sync_wait = 0.0  # seconds the trainer waited in join() (cumulative, reset by metrics())

    # ------------------------------------------------------------------ start / stop
    def start(self, step: int = 0) -> None:
        self.pool.start(step)
        self.pool.form_group(step)
        self.sync_s += self.pool.broadcast(self.weights(), self.version, step)
        self.started = True

    def close(self) -> None:
        try:
            self._drain()
        finally:
            if self._bcast is not None:
                self._bcast.shutdown(wait=False)
            self.pool.close()

    # ------------------------------------------------------------------ the broadcast in flight
    def join(self, step: int) -> None:
        """Wait for the broadcast the last sync started (sync.overlap): the trainer calls this
        before its weights change again. A worker that died in it is recovered (the weights are
        still that version's); any other failure (verification, timeout) raises here.
        Deterministic mode, called before the update (not inside a sync): keeps a copy of this
        version's weights while calls admitted under it run, for a worker that dies in them."""
        if self.det and not self._syncing and (self.calls or self.queue) and \
                (self._held is None or self._held[0] != self.version):
            self._held = (self.version, [(n, t.detach().to("cpu", copy=True), t.device) for n, t in self.weights()])
        if self._inflight is None:
            return
        t0 = time.perf_counter()
        try:
            err = self._inflight.result()  # pool.broadcast bounds every wait by sync.timeout
        finally:
            self._inflight = None
            waited = time.perf_counter() - t0
            self.sync_wait += waited
            self.sync_s += waited
        if isinstance(err, WorkerDied):
            self._recover(err.index, step)
        elif err is not None:
            raise err

    def _drain(self) -> None:
        """Wait for a broadcast in flight and drop its outcome (a recovery re-broadcasts anyway)."""
        if self._inflight is not None:
            fut, self._inflight = self._inflight, None
            fut.result()

    def _broadcast_later(self, named, version: int, step: int) -> None:
        def run():
            try:
                self.pool.broadcast(named, version, step)
                return None
            except BaseException as e:  # handed to join(), in the trainer's thread
                return e

        self.pool.note_bytes(named)  # now, not when the thread gets to it: async/sync_mb of this step
        self._inflight = self._bcast.submit(run)

    # ------------------------------------------------------------------ admission and dispatch
    def limit(self, demand: int = 0) -> int:
        return max(self.consumed_at_version + (self.eta + 1) * self.B, self.consumed + demand)

    def admit(self, demand: int = 0) -> None:
        room = self.limit(demand) - self.admitted
        if room > 0:
            for p in self.sample(room):
                i = self.admitted
                self.admitted += 1
                seed = (self.cfg.seed * 1_000_003 + 7919 * i) % (2 ** 31 - 1) if self.det else None
                self.items[i] = Admitted(i, p, self.version, seed)
                self.queue.append(i)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.queue:
            idxs, self.queue = self.queue[:self.chunk], self.queue[self.chunk:]
            w = min(range(self.pool.n), key=lambda k: (self.outstanding[k], k))
            ids = self.prompt_ids([self.items[i].problem for i in idxs])
            seeds = [self.items[i].seed for i in idxs] if self.det else None
            self._call_seq += 1
            # the worker starts it on weights at least as new as its admission's (an overlapped
            # broadcast of that version may still be on its way)
            newest = max(self.items[i].admit_version for i in idxs)
            # multi-turn episodes need the problems themselves (an environment's reset(row), fork prompts)
            probs = [self.items[i].problem for i in idxs] if self.cfg.rollout.episodes else None
            ref = self.pool.submit(w, self._call_seq, ids, self.G, self.sampling, seeds, newest, probs)
            self.calls[ref] = (w, idxs)
            self.outstanding[w] += len(idxs)

    def _collect(self, step: int, block: bool) -> None:
        """Take in the results of finished calls (waiting for at least one when `block`)."""
        import ray

        if not self.calls:
            if block:
                raise WorkerError(f"step {step}: the trainer waits for rollouts but none is running "
                                  f"(admitted {self.admitted}, consumed {self.consumed}); this is a bug")
            return
        ready, _ = ray.wait(list(self.calls), num_returns=1 if block else len(self.calls),
                            timeout=self.timeout if block else 0)
        if block and not ready:
            busy = sorted({w for w, _ in self.calls.values()})
            raise WorkerError(f"{', '.join(self.pool.name(w) for w in busy)}: generate at step {step} returned nothing "
                              f"within sync.timeout={self.timeout:g} s; raise sync.timeout if generation is only slow")
        for ref in ready:
            if ref not in self.calls:
                continue  # moved back to the queue by a recovery
            w, idxs = self.calls.pop(ref)
            self.outstanding[w] -= len(idxs)
            try:
                res = self.pool.get([ref], [w], "generate", step)[0]
            except WorkerDied as e:
                self.queue = sorted(self.queue + idxs)
                self._recover(e.index, step)
                continue
            for i, g in zip(idxs, res["groups"]):
                self.items[i].groups = g
            self._idle[w] = res["idle_s"]

    def _recover(self, w: int, step: int) -> None:
        """Restart worker `w`; its calls go back to the queue (same indices, seeds, versions), and
        every worker gets the weights of the version they run under: inside a sync the trainer's
        (already the next version's), in deterministic mode after the update the copy `join` kept
        of this version's, else the trainer's (still this version's)."""
        for ref, (ww, idxs) in list(self.calls.items()):
            if ww == w:
                del self.calls[ref]
                self.queue.extend(idxs)
        self.queue.sort()
        self.outstanding[w] = 0
        self._idle[w] = 0.0
        self._drain()  # a broadcast in flight on the old group ends (it fails on the dead member)
        self.pool.restart(w, step)
        self.pool.form_group(step)
        if self._syncing:
            named, version = self.weights(), self.version + 1
        elif self._held is not None and self._held[0] == self.version:
            named, version = [(n, t.to(dev)) for n, t, dev in self._held[1]], self.version
        else:
            named, version = self.weights(), self.version
        self.pool.broadcast(named, version, step)
        self._dispatch()

    # ------------------------------------------------------------------ the trainer's side
    def take(self, n: int, step: int) -> List[Admitted]:
        """At least `n` groups for the trainer (more when more are due this step), oldest first."""
        t0 = time.perf_counter()
        self.admit(demand=n)
        self._collect(step, block=False)
        due = sorted(i for i, it in self.items.items() if it.admit_version + self.eta <= self.version)
        want = max(n, len(due))
        while True:
            chosen = self._choose(due, want)
            if chosen is not None:
                break
            self._collect(step, block=True)
        out = [self.items.pop(i) for i in chosen]
        self.consumed += len(out)
        self.wait_trainer += time.perf_counter() - t0
        return out

    def _choose(self, due: List[int], want: int) -> Optional[List[int]]:
        """The groups to hand over now, or None to wait for more. Deterministic: the `want`
        oldest by admission. Otherwise every due group, then the returned groups of the oldest
        admission version first; a newer version's group never overtakes an older version's
        unreturned one (that keeps the due set within B, see the module docstring), while inside
        one version a straggler is overtaken and taken at the next step."""
        done = lambda i: self.items[i].groups is not None  # noqa: E731
        if self.det:
            chosen = sorted(self.items)[:want]
            return chosen if all(map(done, chosen)) else None
        if not all(map(done, due)):
            return None
        chosen, due_set = list(due), set(due)
        rest = sorted((i for i in self.items if i not in due_set), key=lambda i: (self.items[i].admit_version, i))
        k = 0
        while len(chosen) < want and k < len(rest):
            version = self.items[rest[k]].admit_version
            cohort = []
            while k < len(rest) and self.items[rest[k]].admit_version == version:
                cohort.append(rest[k])
                k += 1
            ready = [i for i in cohort if done(i)]
            chosen += ready[:want - len(chosen)]
            if len(chosen) < want and len(ready) < len(cohort):
                return None  # the rest would overtake this version's unreturned groups
        return chosen if len(chosen) >= want else None

    def sync(self, step: int, changed: bool) -> None:
        """Publish the trainer's next version to every worker, then admit what it allows."""
        if self.det:  # logical clock: every call admitted under this version finishes under it
            while self.calls:  # (a worker dying in one: its prompts run again under the kept weights, _recover)
                self._collect(step, block=True)
        self._held = None
        self._syncing = True
        try:
            self.join(step)  # the previous sync's broadcast, if it is still in flight
            t0 = time.perf_counter()
            version = self.version + 1
            try:
                if changed and self.overlap:  # sent while the trainer computes the next step
                    self._broadcast_later(self.weights(full=False), version, step)
                elif changed:  # full=False: a LoRA policy sends its adapter alone (the workers hold the base)
                    self.pool.broadcast(self.weights(full=False), version, step)
                else:
                    self.pool.set_version(version, step)
            except WorkerDied as e:
                self._recover(e.index, step)  # broadcasts the new version to everyone
            self.sync_s += time.perf_counter() - t0
            self.version = version
            self.consumed_at_version = self.consumed
        finally:
            self._syncing = False
        self.admit()

    def metrics(self, step: int) -> Dict[str, float]:
        self._collect(step, block=False)  # count what has returned by now
        idle = sum(self._idle)
        out = {"async/wait_trainer": self.wait_trainer,
               "async/wait_rollout": max(0.0, idle - self._idle_seen) / max(1, self.pool.n),
               "async/buffer": float(sum(1 for it in self.items.values() if it.groups is not None)),
               "async/inflight": float(sum(1 for it in self.items.values() if it.groups is None)),
               "async/version": float(self.version), "async/worker_restarts": float(self.pool.restarts),
               "async/admitted": float(self.admitted), "async/sync_mb": self.pool.last_bytes / 1e6,
               "async/sync_wait": self.sync_wait}
        self.sync_wait = 0.0
        self._idle_seen = idle
        self.wait_trainer = 0.0
        return out

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> Dict:
        items = []
        for i in sorted(self.items):
            it = self.items[i]
            items.append({"index": i, "problem": it.problem.id, "admit_version": it.admit_version, "seed": it.seed,
                          "groups": None if it.groups is None else [dataclasses.asdict(c) for c in it.groups]})
        return {"version": self.version, "admitted": self.admitted, "consumed": self.consumed,
                "consumed_at_version": self.consumed_at_version, "items": items}

    def load_state_dict(self, state: Dict, step: int) -> None:
        """Restore the buffer and the unreturned prompts (resubmitted at the next take) and
        broadcast the trainer's weights (the checkpoint's) as the saved version."""
        self._drain()
        self._held = None
        for ref in list(self.calls):
            del self.calls[ref]
        self.outstanding = [0] * self.pool.n
        self.version = int(state["version"])
        self.admitted, self.consumed = int(state["admitted"]), int(state["consumed"])
        self.consumed_at_version = int(state["consumed_at_version"])
        self.items, self.queue = {}, []
        for d in state["items"]:
            if d["problem"] not in self.by_id:
                raise ValueError(f"checkpoint: buffered prompt {d['problem']!r} is not in this run's training set; "
                                 "resume with the data the checkpoint was written with")
            groups = None if d["groups"] is None else [Completion(**c) for c in d["groups"]]
            self.items[d["index"]] = Admitted(d["index"], self.by_id[d["problem"]], d["admit_version"], d["seed"], groups)
            if groups is None:
                self.queue.append(d["index"])
        if self.started:
            self.sync_s += self.pool.broadcast(self.weights(), self.version, step)
