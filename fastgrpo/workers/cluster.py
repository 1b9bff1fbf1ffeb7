"""Ray for the asynchronous schedule: start a local instance sized from the config, or join a
running cluster (`ray start --head` on one node, `ray start --address=<head>:6379` on the others,
then `cluster.address=<head>:6379`).

A local Ray gets exactly the CPUs / GPUs the rollout workers ask for (the trainer runs in the
driver process, outside Ray's accounting), a small object store and no dashboard; what a
joined cluster offers is checked against what the workers need before any worker starts, so a
run that cannot be placed fails at once naming the resource instead of waiting forever. A local
Ray's session folder lives in the run's temp folder (`ray_temp_dir`), so nothing of it outlives
the run.

Token authentication (Ray >= 2.5x): `ray start --head` turns it on where a token exists (Ray's
own `ray.init()` writes ~/.ray/auth_token), and Ray presents a token only to a cluster it finds by
itself, never to an explicit address. A head on this machine is joined with this machine's token
(`_join_auth`), as Ray joins one it finds; a head elsewhere needs RAY_AUTH_MODE=token and that
head's token here, which the refusal says.
"""
from __future__ import annotations

import os
from typing import Dict

_STARTED_HERE = False  # this process called ray.init (and so shuts it down)
_OWN_TEMP = None  # a Ray temp folder this process made outside the run folder (removed by stop_ray)
# Ray's longest AF_UNIX path below its temp folder: "/session_<YYYY-mm-dd_HH-MM-SS_µs>_<pid>/sockets/
# plasma_store" is 64 bytes with a 7-digit pid, + ".N" when the name is taken; the limit is 107 bytes
_RAY_SOCKET_TAIL = 68
_SOCKET_MAX = 107


def ray_temp_dir(cfg, log=print):
    """Where a local Ray writes its session folder (sockets, logs, spilled objects): `<run>/tmp/ray`
    inside a run, removed with the run's temp folder at the end and at the next start (every
    async run left a `/tmp/ray/session_*` of 75-125 KB behind: issue 34). A run folder whose path
    leaves no room for Ray's sockets gets a short private folder in /tmp instead, said once and
    removed by `stop_ray`. Outside a run (a library user's Ray): None, Ray's own default."""
    import tempfile

    global _OWN_TEMP
    run_tmp = os.path.abspath(os.path.join(cfg.logging.out_dir, "tmp"))
    if os.path.abspath(tempfile.gettempdir()) != run_tmp:  # not inside fastgrpo.runs.folder.run_tmpdir
        return None if len(tempfile.gettempdir()) <= 24 else "/tmp/ray"
    want = os.path.join(run_tmp, "ray")
    if len(want.encode()) + _RAY_SOCKET_TAIL <= _SOCKET_MAX:
        return want
    _OWN_TEMP = tempfile.mkdtemp(prefix="fastgrpo-ray-", dir="/tmp")
    log(f"[fastgrpo] Ray's session folder: {_OWN_TEMP}, not {want} (that path is {len(want.encode())} bytes; "
        f"Ray's socket paths below it must fit {_SOCKET_MAX}: keep the run folder under "
        f"{_SOCKET_MAX - _RAY_SOCKET_TAIL - len('/tmp/ray')} characters); removed at the end")
    return _OWN_TEMP


def worker_resources(cfg) -> Dict[str, float]:
    """Ray resources of one rollout worker: its threads as CPUs, its GPUs."""
    import torch

    gpus = cfg.cluster.gpus_per_worker
    if gpus < 0:
        gpus = 1.0 if (cfg.cluster.address == "" and torch.cuda.is_available()) else 0.0
    return {"num_cpus": float(cfg.rollout.worker_threads), "num_gpus": float(gpus)}


def _on_this_machine(address: str) -> bool:
    """Whether a host:port names this machine (loopback, or an address one of its interfaces has)."""
    import socket

    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        ip = socket.gethostbyname(host)
        with socket.socket() as s:
            s.bind((ip, 0))  # only an address of this machine binds
        return True
    except OSError:
        return False


def _join_auth(address: str) -> bool:
    """Turn on Ray's token authentication for joining `address` when the head is on this machine,
    RAY_AUTH_MODE is not set and this machine has a token: what `ray start --head` did with the
    same token (without it the join fails after ~30 s as "Failed to connect"). Returns whether
    the join presents a token."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    if address == "auto" or not _on_this_machine(address):
        return False  # "auto": Ray's own lookup does this; elsewhere: the user's call (the refusal says how)
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
            return False
        os.environ["RAY_AUTH_MODE"] = "token"  # read by this process's Ray core and its children
        Config.initialize("")
        return True
    except Exception:  # noqa: BLE001 — a Ray without token authentication: nothing to turn on
        return False


def start_ray(cfg, log=print) -> None:
    """`ray.init` for this run (no-op when Ray is already up in this process, e.g. a test's)."""
    import ray

    global _STARTED_HERE
    need = worker_resources(cfg)
    if not ray.is_initialized():
        c = cfg.cluster
        kw = dict(include_dashboard=False, log_to_driver=True, configure_logging=False)
        if c.address:
            token = _join_auth(c.address)
            try:
                ray.init(address=c.address, **kw)
            except Exception as e:  # noqa: BLE001 — any failure to join: one line naming the address
                hint = "" if token else (" (or its head asks for a token: Ray's default where ~/.ray/auth_token "
                                         "exists; set RAY_AUTH_MODE=token here, with that head's token in "
                                         "~/.ray/auth_token or RAY_AUTH_TOKEN)")
                raise RuntimeError(f"cluster.address={c.address!r}: could not join the Ray cluster "
                                   f"({(str(e).strip().splitlines() or [type(e).__name__])[0]}); is `ray start "
                                   f"--head` running there?{hint}") from None
        else:
            cpus = c.num_cpus or int(cfg.rollout.workers * need["num_cpus"])
            gpus = c.num_gpus or (int(cfg.rollout.workers * need["num_gpus"] + 0.999) if need["num_gpus"] else 0)
            tmp = ray_temp_dir(cfg, log)
            try:
                ray.init(num_cpus=max(cpus, 1), num_gpus=gpus, object_store_memory=c.object_store_mb << 20,
                         _temp_dir=tmp, **kw)
            except Exception as e:  # noqa: BLE001 — one line naming what failed
                stop_ray()  # a private temp folder made for it goes too
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
    global _STARTED_HERE, _OWN_TEMP
    if _STARTED_HERE:
        import ray

        ray.shutdown()
        _STARTED_HERE = False
    if _OWN_TEMP is not None:  # Ray's processes are gone: its session folder can go
        import shutil

        shutil.rmtree(_OWN_TEMP, ignore_errors=True)
        _OWN_TEMP = None
