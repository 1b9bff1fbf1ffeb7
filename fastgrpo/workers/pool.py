"""The rollout worker actors as seen from trainer rank 0: start them, form the broadcast group,
broadcast and verify weights, submit generate calls, restart a worker that died.

Every RPC waits at most `sync.timeout` seconds and every failure raises `WorkerError` with one
line naming the worker (index and pid), the step and the operation — a worker that cannot start
fails here, at start, naming why (its constructor's error, or the resources nobody offers).
A dead worker is replaced by a fresh actor; the broadcast group is formed again with it (a gloo
group cannot take a new member) and the current weights are broadcast to everyone. Ray places the
fresh actor on any node with room (a worker whose node left the cluster starts on another one);
when no node left could hold the workers the run stops at once, naming the node that left,
instead of waiting for a node that may never come.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

from fastgrpo.sync import broadcast as bc
from fastgrpo.workers.cluster import worker_resources
from fastgrpo.workers.rollout_worker import RolloutWorker


START_S = 300.0  # seconds a worker may take to start when sync.timeout is shorter


class WorkerError(RuntimeError):
    """A rollout worker failed, timed out or could not start (the message names it)."""


class WorkerDied(WorkerError):
    def __init__(self, index: int, msg: str):
        super().__init__(msg)
        self.index = index


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    # Ray wraps the actor's own exception in a traceback dump: keep its last meaningful line
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith(("File ", "^", "~", "Traceback")) and ":" in ln:
            return ln[:400]
    return (lines[-1] if lines else type(e).__name__)[:400]


class WorkerPool:
    def __init__(self, cfg, build_engine, log=print):
        self.cfg = cfg
        self.build_engine = build_engine  # (cfg, prompt_len) -> (engine, kind), run inside each worker
        self.log = log
        self.timeout = float(cfg.sync.timeout)
        self.n = cfg.rollout.workers
        self.actors: List = [None] * self.n
        self.pids: List[Optional[int]] = [None] * self.n
        self.engines: List[Optional[str]] = [None] * self.n  # torch | vllm, as each worker reported
        self.nodes: List[Optional[str]] = [None] * self.n  # each worker's Ray node
        self.transport: Optional[str] = None  # group | shm (sync.transport, chosen by form_group)
        self._shm_failed: Optional[str] = None  # why shared memory did not serve (auto then sends over the group)
        self.channel = None  # rank 0's segment (fastgrpo.sync.shm.ShmTransport) under shm
        self.group: Optional[bc.BroadcastGroup] = None
        self.restarts = 0
        self.last_bytes = 0  # bytes of the last broadcast (async/sync_mb)
        self.bucket_bytes = int(cfg.sync.bucket_mb) << 20
        self._plan_key = None
        self._plan = None
        self.prompt_len = 0  # tokens of the longest prompt (sizes a vLLM worker's context)

    # ------------------------------------------------------------------ lifecycle
    def name(self, i: int) -> str:
        return f"rollout worker {i} (pid {self.pids[i]})" if self.pids[i] else f"rollout worker {i}"

    def _new_actor(self, i: int):
        import ray

        if self.channel is not None:
            # rank 0's segment lost its name once every worker had mapped it: a new worker needs a new one
            self.channel.close()
            self.channel = None

        cls = ray.remote(concurrency_groups={"gen": 1, "sync": 2}, max_restarts=0)(RolloutWorker)
        cls = cls.options(**worker_resources(self.cfg))
        return cls.remote(self.cfg, i, self.build_engine, self.prompt_len)

    def start(self, step: int = 0) -> None:
        from fastgrpo.sync.shm import sweep

        sweep()  # segments of this node's dead runs (a killed trainer's, a crashed worker's) go first
        for i in range(self.n):
            self.actors[i] = self._new_actor(i)
        for i in range(self.n):
            info = self._start_wait(i, step)
            self.pids[i], self.engines[i], self.nodes[i] = info["pid"], info["engine"], info.get("node")
        self.log(f"[fastgrpo] {self.n} rollout worker(s) up: pids {self.pids}, engines {self.engines}")

    def _start_wait(self, i: int, step: int, why: Optional[str] = None) -> Dict:
        """Wait for worker i's `ready`; `why`: what the failure of a restart says first (the death)."""
        import ray

        ref = self.actors[i].ready.options(concurrency_group="sync").remote()
        # a start loads torch and the model (vLLM: its engine too): minutes on a busy machine
        limit = max(self.timeout, START_S)
        deadline = time.monotonic() + limit
        try:
            while True:
                # a worker nobody can place fails now (a node left), not after the whole allowance
                short = self.unplaceable()
                if short is not None:
                    raise WorkerError(f"{why or f'rollout worker {i} cannot start (step {step})'}: {short}")
                try:
                    return ray.get(ref, timeout=max(0.0, min(2.0, deadline - time.monotonic())))
                except ray.exceptions.GetTimeoutError:
                    if time.monotonic() >= deadline:
                        raise
        except ray.exceptions.GetTimeoutError:
            self._kill(i)
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            raise WorkerError(f"rollout worker {i} did not start within {limit:g} s (step {step}): it needs "
                              f"{worker_resources(self.cfg)} and the cluster has {free} free; if that is enough it is "
                              "still loading: raise sync.timeout") from None
        except WorkerError:
            self._kill(i)  # never placed: its close() would wait for nothing
            raise
        except Exception as e:  # noqa: BLE001 — the actor's constructor raised, or it died
            self._kill(i)
            raise WorkerError(f"rollout worker {i} could not start (step {step}): {_first_line(e)}") from None

    def _kill(self, i: int) -> None:
        import ray

        if self.actors[i] is not None:
            try:
                ray.kill(self.actors[i], no_restart=True)
            except Exception:  # noqa: BLE001 — already gone
                pass
            self.actors[i] = None

    def unplaceable(self) -> Optional[str]:
        """None when the live Ray nodes have room for every worker (each node counted by how many
        workers its CPUs / GPUs hold), else one phrase saying what they offer."""
        import ray

        need = worker_resources(self.cfg)
        slots, offers = 0, []
        for node in ray.nodes():
            if not node.get("Alive"):
                continue
            res = node.get("Resources") or {}
            fit = [int(res.get(key, 0.0) / need[k] + 1e-9) for k, key in (("num_cpus", "CPU"), ("num_gpus", "GPU"))
                   if need[k] > 0]
            slots += min(fit) if fit else 1
            gpu = f" + {res.get('GPU', 0.0):g} GPU" if need["num_gpus"] else ""
            offers.append(f"{res.get('CPU', 0.0):g} CPU{gpu}")
        if slots >= self.n:
            return None
        each = f"{need['num_cpus']:g} CPU" + (f" + {need['num_gpus']:g} GPU" if need["num_gpus"] else "")
        return (f"the live Ray nodes ({', '.join(offers) or 'none'}) hold {slots} of the {self.n} worker(s) of {each} "
                "each; add a node or lower rollout.workers / rollout.worker_threads")

    def node_left(self, node_id: Optional[str]) -> Optional[str]:
        """'Ray node <id> (<ip>)' when `node_id` is no longer a live node of the cluster, else None."""
        import ray

        if not node_id:
            return None
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                if node.get("Alive"):
                    return None
                return f"Ray node {node_id[:12]} ({node.get('NodeManagerAddress', '?')})"
        return f"Ray node {node_id[:12]}"

    def restart(self, i: int, step: int) -> None:
        self._kill(i)
        self.restarts += 1
        left = self.node_left(self.nodes[i])
        died = f"{self.name(i)} died at step {step}" + (f" with its {left}, which left the cluster" if left else "")
        short = self.unplaceable()
        if short is not None:  # nowhere to go: stop now, naming the node (nothing waits for a node that may not come)
            raise WorkerError(f"{died}; it cannot restart: {short}")
        self.log(f"[fastgrpo] {died}: restarting it{' on another node' if left else ''} (restart {self.restarts})")
        self.actors[i] = self._new_actor(i)
        info = self._start_wait(i, step, why=f"{died}; it cannot restart")
        self.pids[i], self.nodes[i] = info["pid"], info.get("node")

    def close(self) -> None:
        import ray

        for a in self.actors:
            if a is not None:
                try:
                    ray.get(a.close.options(concurrency_group="sync").remote(), timeout=30)
                except Exception:  # noqa: BLE001 — dead or stuck: killed below
                    pass
                try:
                    ray.kill(a, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
        self.actors = [None] * self.n
        self.group = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    # ------------------------------------------------------------------ RPC with deadlines
    def get(self, refs: Sequence, who: Sequence[int], op: str, step: int) -> List:
        """ray.get of one ref per worker in `who`, each within the timeout; a dead worker raises
        WorkerDied(index), anything else WorkerError naming worker, step and operation."""
        import ray

        out = []
        deadline = time.monotonic() + self.timeout
        for ref, i in zip(refs, who):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except ray.exceptions.GetTimeoutError:
                raise WorkerError(f"{self.name(i)}: {op} at step {step} timed out after sync.timeout={self.timeout:g} s; "
                                  "raise sync.timeout if the worker is only slow, else check its log") from None
            except ray.exceptions.RayActorError as e:
                raise WorkerDied(i, f"{self.name(i)} died during {op} at step {step}: {_first_line(e)}") from None
            except bc.SyncVerificationError:
                raise
            except Exception as e:  # noqa: BLE001 — the worker's own error, one line
                raise WorkerError(f"{self.name(i)}: {op} at step {step} failed: {_first_line(e)}") from None
        return out

    def alive(self) -> List[bool]:
        import ray

        refs = [None if a is None else a.ready.options(concurrency_group="sync").remote() for a in self.actors]
        ok = []
        for r in refs:
            if r is None:  # a worker that could not restart
                ok.append(False)
                continue
            try:
                ray.get(r, timeout=min(self.timeout, 30.0))
                ok.append(True)
            except Exception:  # noqa: BLE001
                ok.append(False)
        return ok

    # ------------------------------------------------------------------ the broadcast group
    def _device(self) -> str:
        import torch

        # NCCL when the trainer and the workers hold GPUs, gloo otherwise (every member the same)
        return "cuda" if torch.cuda.is_available() and worker_resources(self.cfg)["num_gpus"] > 0 else "cpu"

    def _choose_transport(self, step: int) -> str:
        """sync.transport: `shm` (one shared-memory segment, each worker copies out of it: a pack
        and a copy instead of gloo's socket round trips; SmolLM2-135M's 538 MB cost 0.15 s of
        rank 0's CPU instead of 0.64 s, benchmarks/bench_broadcast.py) needs every worker on this
        Ray node; `auto` takes it for CPU workers there and the group otherwise (GPU workers:
        NCCL; a worker on another node)."""
        import ray

        want = self.cfg.sync.transport
        if want == "group":
            return "group"
        here = ray.get_runtime_context().get_node_id()
        away = [i for i in range(self.n) if self.nodes[i] != here]
        if want == "shm" and away:
            raise WorkerError(f"sync.transport=shm at step {step}: {self.name(away[0])} runs on another node than the "
                              "trainer (shared memory reaches this node only); use sync.transport=group or auto")
        if want == "auto" and (away or self._device() == "cuda" or self._shm_failed):
            return "group"
        return "shm"

    def form_group(self, step: int) -> None:
        """What carries the broadcasts (sync.transport): a fresh stateless group — rank 0 here,
        worker i is rank i + 1 — or rank 0's shared memory (nothing to form)."""
        import ray

        transport = self._choose_transport(step)
        if transport != self.transport:
            self.log(f"[fastgrpo] weight broadcasts to the rollout workers: "
                     f"{'shared memory (every worker on this node)' if transport == 'shm' else 'over a process group'}")
        self.transport = transport
        if self.transport == "shm":
            self.group = None
            return
        # loopback serves workers on this node only: a worker on another node (a joined cluster, or a
        # Ray this process was connected to before the run) reaches rank 0 at this node's address
        here = ray.get_runtime_context().get_node_id()
        away = self.cfg.cluster.address or any(node != here for node in self.nodes)
        host = ray.util.get_node_ip_address() if away else "127.0.0.1"
        world = self.n + 1
        device = self._device()
        store, port = bc.BroadcastGroup.serve(host, world, self.timeout)
        refs = [a.join_group.options(concurrency_group="sync").remote(host, port, i + 1, world, self.timeout, device)
                for i, a in enumerate(self.actors)]
        try:
            self.group = bc.BroadcastGroup(host, port, 0, world, self.timeout, device=device, store=store)
        except bc.BroadcastError as e:
            self.get(refs, range(self.n), "joining the weight-broadcast group", step)  # names the worker that failed
            raise WorkerError(f"weight-broadcast group at step {step}: {e}") from None
        self.get(refs, range(self.n), "joining the weight-broadcast group", step)

    def broadcast(self, named: List[Tuple[str, object]], version: int, step: int) -> float:
        """Send `named` as `version` to every worker and verify what each staged. Returns seconds."""
        t0 = time.perf_counter()
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in named)
        if key != self._plan_key:
            self._plan_key, self._plan = key, bc.plan(named, self.bucket_bytes)
        what = f"weight broadcast of version {version} at step {step}"
        # sent along: a worker stages only tensors that match them, so it never samples from weights
        # that fail the verification below (it would until rank 0 had compared, and ends the run then)
        expected = bc.checksums(named)
        if self.transport == "shm":
            return self._broadcast_shm(named, version, step, what, t0, expected)
        refs = [a.receive_weights.options(concurrency_group="sync").remote(version, self._plan, None, expected)
                for a in self.actors]
        try:
            bc.send(self.group, named, self._plan, what)
        except bc.BroadcastError as e:
            alive = self.alive()
            dead = [i for i, ok in enumerate(alive) if not ok]
            if dead:
                raise WorkerDied(dead[0], f"{self.name(dead[0])} died during the {what}") from None
            raise WorkerError(f"{e} (workers {[self.name(i) for i in range(self.n)]})") from None
        self.note_bytes(named)
        results = self.get(refs, range(self.n), what, step)
        for i, (got_version, sums) in enumerate(results):
            bc.verify(expected, sums, f"{self.name(i)} at step {step}", version, got_version)
        return time.perf_counter() - t0

    def _broadcast_shm(self, named, version: int, step: int, what: str, t0: float, expected: Dict) -> float:
        import ray

        from fastgrpo.sync.shm import ShmTransport

        if self.channel is None:
            self.channel = ShmTransport(n_buffers=1)
        try:
            payload = bc.send_shm(self.channel, named, self._plan)
        except OSError as e:  # /dev/shm too small for the weights
            if self.cfg.sync.transport == "shm":
                raise WorkerError(f"{what}: {e}; make /dev/shm larger or use sync.transport=group") from None
            self._shm_failed = str(e)
            self.log(f"[fastgrpo] {what}: {e}; broadcasting over the group instead")
            self.channel.close()
            self.form_group(step)
            return self.broadcast(named, version, step)
        refs = [a.receive_weights.options(concurrency_group="sync").remote(version, self._plan, payload, expected)
                for a in self.actors]
        self.note_bytes(named)
        # every worker is done with the segment before anything is raised: a recovery packs into it again
        ray.wait(refs, num_returns=len(refs), timeout=self.timeout)
        results = self.get(refs, range(self.n), what, step)
        # every worker has mapped the segment: its name goes, so no death (ours or theirs) can leave it in /dev/shm
        self.channel.unlink()
        for i, (got_version, sums) in enumerate(results):
            bc.verify(expected, sums, f"{self.name(i)} at step {step}", version, got_version)
        return time.perf_counter() - t0

    def note_bytes(self, named) -> None:
        """The payload of a broadcast, for async/sync_mb."""
        self.last_bytes = sum(t.numel() * t.element_size() for _, t in named)

    def set_version(self, version: int, step: int) -> None:
        refs = [a.set_version.options(concurrency_group="sync").remote(version) for a in self.actors]
        self.get(refs, range(self.n), f"version bump to {version}", step)

    def submit(self, i: int, call_id: int, prompt_ids, n: int, sampling, seeds, min_version: int = 0, problems=None):
        return self.actors[i].generate.options(concurrency_group="gen").remote(call_id, prompt_ids, n, sampling, seeds,
                                                                               min_version, problems)

    def stats(self, step: int) -> List[Dict]:
        refs = [a.stats.options(concurrency_group="sync").remote() for a in self.actors]
        return self.get(refs, range(self.n), "stats", step)
