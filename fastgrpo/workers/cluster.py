"""Ray for the asynchronous schedule: start a local instance sized from the config, or join a
running cluster (`ray start --head` on one node, `ray start --address=<head>:6379` on the others,
then `cluster.address=<head>:6379`).

A local Ray gets exactly the CPUs / GPUs the rollout workers ask for (the trainer runs in the
driver process, outside Ray's accounting), a small object store and no dashboard; what a
joined cluster offers is checked against what the workers need before any worker starts, so a
run that cannot be placed fails at once naming the resource instead of waiting forever.
"""
from __future__ import annotations

from typing import Dict

_STARTED_HERE = False  # this process called ray.init (and so shuts it down)


def worker_resources(cfg) -> Dict[str, float]:
    """Ray resources of one rollout worker: its threads as CPUs, its GPUs."""
    import torch

    gpus = cfg.cluster.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if (cfg.cluster.address == "" and torch.cuda.is_available()) else 0.0
    return {"num_cpus": float(cfg.rollout.worker_threads), "num_gpus": float(gpus)}


def start_ray(cfg, log=print) -> None:
    """`ray.init` for this run (no-op when Ray is already up in this process, e.g. a test's)."""
    import ray

    global _STARTED_HERE
    need = worker_resources(cfg)
    if not ray.is_initialized():
        c = cfg.cluster
        kw = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
        if c.address:
            try:
                ray.init(address=c.address, **kw)
            except Exception as e:  # noqa: BLE001 — any failure to join: one line naming the address
                raise RuntimeError(f"cluster.address={c.address!r}: could not join the Ray cluster "
                                   f"({(str(e).strip().splitlines() or [type(e).__name__])[0]}); is `ray start "
                                   "--head` running there?") from None
        else:
            cpus = c.num_cpus or int(cfg.rollout.workers * need["num_cpus"])
            gpus = c.num_gpus or (int(cfg.rollout.workers * need["num_gpus"] + 0.999) if need["num_gpus"] else 0)
            import tempfile

            # Ray's sockets live under its temp dir and AF_UNIX paths stop at 107 bytes: a run's
            # own tmp folder (<out_dir>/tmp, fastgrpo.runs.folder) is often longer
            tmp = None if len(tempfile.gettempdir()) <= 24 else "/tmp/ray"
            try:
                ray.init(num_cpus=max(cpus, 1), num_gpus=gpus, object_store_memory=c.object_store_mb << 20,
                         _temp_dir=tmp, **kw)
            except Exception as e:  # noqa: BLE001 — one line naming what failed
                raise RuntimeError(f"starting a local Ray for rollout.mode=async failed: "
                                   f"{(str(e).strip().splitlines() or [type(e).__name__])[-1]}") from None
        _STARTED_HERE = True
        log(f"[fastgrpo] Ray {'joined at ' + c.address if c.address else 'started locally'}: "
            f"{ {k: v for k, v in ray.cluster_resources().items() if k in ('CPU', 'GPU')} }")
    have = ray.cluster_resources()
    for key, res in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        want = cfg.rollout.workers * need[key]
        if want > have.get(res, 0.0) + 1e-9:
            raise RuntimeError(f"rollout.workers={cfg.rollout.workers}: the workers need {want:g} {res} "
                               f"({need[key]:g} each) but the Ray cluster has {have.get(res, 0.0):g}; lower "
                               "rollout.workers / rollout.worker_threads / cluster.gpus_per_worker or add nodes")


def stop_ray() -> None:
    """Shut Ray down if this run started it."""
    global _STARTED_HERE
    if _STARTED_HERE:
        import ray

        ray.shutdown()
        _STARTED_HERE = False
