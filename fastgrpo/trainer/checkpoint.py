"""Atomic training checkpoints: write into a temp directory, fsync, then rename.

A checkpoint is `<out>/checkpoints/step-00000012/` holding `model/` (HF `save_pretrained`, so
vLLM / from_pretrained / `fastgrpo eval` load it directly), `state.pt` (optimizer, scheduler,
curriculum, trainer extras, RNG states of python / numpy / torch / CUDA) and `meta.json`
(step; written last). The directory is first built as `.tmp-step-…-<pid>` and then renamed:
rename(2) within one file system is atomic, so a process killed at any instant (kill -9) leaves
either the previous checkpoints only or the new complete one — never a half-written
`step-…`. Temp directories left by a killed writer are removed by the next save. Pruning keeps
the newest `keep_last` complete checkpoints and never deletes the one just written. This is the
scheme of HF Trainer / DeepSpeed's "latest" pointer reduced to a rename, with the departure that
"latest" is derived from the directory names instead of a pointer file (one file fewer to tear).

Under DeepSpeed ZeRO the optimizer state is partitioned over ranks: every rank writes its
partition (DeepSpeed's own `engine.save_checkpoint` layout, under `engine/`) and its RNG state
(`rng-rank<r>.pt`) into the one temp directory of rank 0 (`shards=`), before the rename — so
the checkpoint is still complete or absent, never partial. That needs a file system shared by
the ranks (one node, or a shared mount), as DeepSpeed's own checkpoints do.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

_NAME = re.compile(r"^step-(\d{8})$")
_OLD = re.compile(r"^step-(\d{8})\.old-(\d+)$")


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(path: str) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(out_dir: str) -> List[str]:
    """Complete checkpoints (name step-NNNNNNNN with meta.json), oldest first. A step whose
    re-save was killed between its two renames (`save_checkpoint`) is listed under its swapped
    out name `step-NNNNNNNN.old-<pid>`: it is complete, and it is that step's only copy."""
    root = ckpt_root(out_dir)
    if not os.path.isdir(root):
        return []
    found = {}
    for name in os.listdir(root):
        m = _NAME.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            found[int(m.group(1))] = os.path.join(root, name)
    for step, path in _orphaned_swaps(root):
        found.setdefault(step, path)
    return [found[k] for k in sorted(found)]


def _swapped_out(root: str):
    """(step, path, pid) of every `step-NNNNNNNN.old-<pid>` directory (a re-save's old copy)."""
    for name in os.listdir(root):
        m = _OLD.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            yield int(m.group(1)), os.path.join(root, name), int(m.group(2))


def _orphaned_swaps(root: str):
    """Swapped-out copies whose step directory is missing (a re-save killed between its
    renames, or one in progress right now): (step, path). Whatever the pid — a restarted
    container often gets the same one — the copy is complete, and that step's only one."""
    for step, path, _ in _swapped_out(root):
        if not os.path.exists(os.path.join(root, f"step-{step:08d}", "meta.json")):
            yield step, path


def _recover_swaps(root: str) -> None:
    """Finish re-saves that a dead process left half done: put an orphaned old copy back in
    place, and delete an old copy whose step directory was already replaced."""
    for step, path, pid in list(_swapped_out(root)):
        # our own pid cannot be mid-swap here (saves run one at a time); another live pid may
        # be (or be an unrelated process that reuses a dead writer's pid: its copy is still
        # listed by list_checkpoints, and our own re-save of the step clears the name first)
        if pid != os.getpid() and _pid_alive(pid):
            continue
        final = os.path.join(root, f"step-{step:08d}")
        if os.path.exists(os.path.join(final, "meta.json")):
            shutil.rmtree(path, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)  # nothing complete there (a partial copy at most)
            os.rename(path, final)


def latest_checkpoint(out_dir: str) -> Optional[str]:
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_tmp(root: str) -> None:
    for name in os.listdir(root):
        if not name.startswith(".tmp-"):
            continue
        try:
            pid = int(name.rsplit("-", 1)[1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and (pid < 0 or not _pid_alive(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def begin_path(out_dir: str, step: int) -> str:
    """The temp directory that `save_checkpoint` of this process builds step `step` in."""
    return os.path.join(ckpt_root(out_dir), f".tmp-step-{step:08d}-{os.getpid()}")


def save_checkpoint(out_dir: str, step: int, model, optimizer=None, scheduler=None, curriculum=None,
                    tokenizer=None, extra: Optional[Dict[str, Any]] = None, keep_last: int = 2,
                    model_state: Optional[Dict[str, torch.Tensor]] = None,
                    shards: Optional[Callable[[str], None]] = None, tmp: Optional[str] = None) -> str:
    """Write checkpoint `step` atomically and prune older ones; returns its directory.

    `model` is saved with `save_pretrained` when it has one (else its state_dict); pass
    `model_state` to save a state dict gathered elsewhere (e.g. ZeRO-3 shards) instead.
    `shards(tmp_dir)` writes state that lives on several ranks (ZeRO optimizer partitions)
    into the temp directory before it is fsynced and renamed, so it is covered by the same
    atomic rename; it must return only when every rank has finished writing. `tmp` is the
    temp directory to use (`begin_path`, sent to the other ranks beforehand).
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: expected an integer >= 0")
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r}: expected an integer >= 1")
    root = ckpt_root(out_dir)
    os.makedirs(root, exist_ok=True)
    _remove_stale_tmp(root)
    _recover_swaps(root)
    final = os.path.join(root, f"step-{step:08d}")
    tmp = tmp or begin_path(out_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        mdir = os.path.join(tmp, "model")
        if hasattr(model, "save_pretrained"):
            model.save_pretrained(mdir, safe_serialization=True, state_dict=model_state)
        else:
            os.makedirs(mdir)
            torch.save(model_state if model_state is not None else model.state_dict(), os.path.join(mdir, "model.pt"))
        if tokenizer is not None:
            tokenizer.save_pretrained(mdir)
        if shards is not None:
            shards(tmp)
        state = {
            "step": step,
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "curriculum": curriculum.state_dict() if curriculum is not None else None,
            "rng": rng_state(),
            "extra": extra or {},
        }
        torch.save(state, os.path.join(tmp, "state.pt"))
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "format": 1}, f)
        _fsync_tree(tmp)
    except BaseException:
        # a failed write (a rank died inside `shards`, disk full) leaves only the complete
        # checkpoints; remove the partial temp directory now instead of at the next process's save
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):  # re-saving a step (resumed run): swap the old one out first
        old = final + f".old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)  # an earlier process with this pid left it (its step is complete)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    _prune(out_dir, keep_last, keep=final)
    return final


def _prune(out_dir: str, keep_last: int, keep: str) -> None:
    ckpts = list_checkpoints(out_dir)
    doomed = [p for p in ckpts[:-keep_last] if p != keep and p != ckpts[-1]]
    for p in doomed:
        # rename first so that a kill during rmtree never leaves a step-… without its files
        trash = os.path.join(os.path.dirname(p), f".tmp-trash-{os.path.basename(p)}-{os.getpid()}")
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)


def load_model_state(path: str) -> Dict[str, torch.Tensor]:
    """The model weights of a checkpoint directory as a state dict."""
    mdir = os.path.join(path, "model")
    st = os.path.join(mdir, "model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file

        return load_file(st)
    index = os.path.join(mdir, "model.safetensors.index.json")
    if os.path.exists(index):  # save_pretrained shards models over its max_shard_size
        from safetensors.torch import load_file

        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state: Dict[str, torch.Tensor] = {}
        for name in files:
            state.update(load_file(os.path.join(mdir, name)))
        return state
    pt = os.path.join(mdir, "model.pt")
    if os.path.exists(pt):
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ValueError(f"checkpoint {path}: no model/model.safetensors, model/model.safetensors.index.json or model/model.pt inside")


def load_checkpoint(path: str, model=None, optimizer=None, scheduler=None, curriculum=None,
                    restore_rng: bool = True) -> Dict[str, Any]:
    """Restore what is given from checkpoint `path`; returns the state dict (step, extra, …)."""
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise ValueError(f"checkpoint {path!r}: not a complete checkpoint (no meta.json)")
    state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
    if model is not None:
        weights = load_model_state(path)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        # tied embeddings are saved once: a missing lm_head.weight tied to the input embedding is fine
        tied = {"lm_head.weight"} if getattr(getattr(model, "config", None), "tie_word_embeddings", False) else set()
        bad = [k for k in missing if k not in tied]
        if bad or unexpected:
            raise ValueError(f"checkpoint {path}: weights do not match the model (missing {bad[:5]}, "
                             f"unexpected {list(unexpected)[:5]})")
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state.get("scheduler") is not None:
        scheduler.load_state_dict(state["scheduler"])
    if curriculum is not None and state.get("curriculum") is not None:
        curriculum.load_state_dict(state["curriculum"])
    if restore_rng:
        set_rng_state(state["rng"])
    return state
