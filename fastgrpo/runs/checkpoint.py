"""Atomic training checkpoints: write into a temp directory, fsync, then rename.

A checkpoint is `<out>/checkpoints/step-00000012/` holding `model/` (HF `save_pretrained`, so
vLLM / from_pretrained / `fastgrpo eval` load it directly), `state.pt` (optimizer, scheduler,
curriculum, trainer extras, RNG states of python / numpy / torch / CUDA), `meta.json` (step) and
`checksums.json` (sha256 and size of every other file; written last, verified on load: a flipped
byte or a truncated file is caught before it is trained on). The directory is first built as
`.tmp-step-…-<pid>` and then renamed: rename(2) within one file system is atomic, so a process
killed at any instant (kill -9) leaves either the previous checkpoints only or the new complete
one — never a half-written `step-…`. Temp directories left by a killed writer are removed by the
next save. Pruning keeps the newest `keep_last` complete checkpoints and never deletes the one
just written. This is the scheme of HF Trainer / DeepSpeed's "latest" pointer reduced to a
rename, with the departure that "latest" is derived from the directory names instead of a
pointer file (one file fewer to tear).

Under DeepSpeed ZeRO the optimizer state is partitioned over ranks: every rank writes its
partition (DeepSpeed's own `engine.save_checkpoint` layout, under `engine/`) and its RNG state
(`rng-rank<r>.pt`) into the one temp directory of rank 0 (`shards=`), before the rename — so
the checkpoint is still complete or absent, never partial. That needs a file system shared by
the ranks (one node, or a shared mount), as DeepSpeed's own checkpoints do.

Resume takes the newest checkpoint that verifies (`latest_checkpoint`) and says which newer ones
it skipped and why (the file, and whether it is missing, truncated or changed); a load error of
torch or safetensors is re-raised as a `CheckpointError` (a ValueError) naming the file. Hashing
reads every byte once per save and once per resume (sha256: ~1-2 GB/s on one core). The same
temp-then-rename scheme, with the checksum file as the completeness marker, saves HF model
folders (`save_model_atomic` / `is_complete_model_dir`, for the SFT model) and single files
(`atomic_write_text`, e.g. config.yaml).

This module is the writing side (temp folder, fsync, rename, prune, recovery of interrupted
re-saves); listing, verification, "latest" selection and restore live in
`fastgrpo.runs.checkpoint_load` and are re-exported here, so `fastgrpo.runs.checkpoint`
stays the one import for both.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Dict, Optional

import torch

from fastgrpo.runs.folder import saving
from fastgrpo.runs.checkpoint_load import (  # noqa: F401  (re-exported: the module's public names)
    CHECKSUMS,
    MODEL_MARKER,
    CheckpointError,
    ckpt_root,
    is_complete_model_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_model_state,
    load_torch_file,
    logger,
    pid_alive,
    rng_state,
    set_rng_state,
    swapped_out,
    verify_checkpoint,
    verify_dir,
    write_checksums,
)


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


def _recover_swaps(root: str) -> None:
    """Finish re-saves that a dead process left half done: put an orphaned old copy back in
    place, and delete an old copy whose step directory was already replaced."""
    for step, path, pid in list(swapped_out(root)):
        # our own pid cannot be mid-swap here (saves run one at a time); another live pid may
        # be (or be an unrelated process that reuses a dead writer's pid: its copy is still
        # listed by list_checkpoints, and our own re-save of the step clears the name first)
        if pid != os.getpid() and pid_alive(pid):
            continue
        final = os.path.join(root, f"step-{step:08d}")
        if os.path.exists(os.path.join(final, "meta.json")):
            shutil.rmtree(path, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)  # nothing complete there (a partial copy at most)
            os.rename(path, final)


def _remove_stale_tmp(root: str) -> None:
    for name in os.listdir(root):
        if not name.startswith(".tmp-"):
            continue
        try:
            pid = int(name.rsplit("-", 1)[1])
        except ValueError:
            pid = -1
        if pid != os.getpid() and (pid < 0 or not pid_alive(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def torch_save(obj, path: str) -> None:
    """`torch.save(obj, path)` through a Python file: torch's own C++ stream turns a full disk into
    "basic_ios::clear: iostream error" with no errno (issue 34: rc 1 and a traceback), where a
    Python file raises OSError(ENOSPC) that `fastgrpo.runs.folder.saving` names in one line."""
    with open(path, "wb") as f:
        torch.save(obj, f)


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
    if not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)
        _fsync_dir(out_dir)  # the new checkpoints/ entry itself survives a power cut
    _remove_stale_tmp(root)
    _recover_swaps(root)
    final = os.path.join(root, f"step-{step:08d}")
    tmp = tmp or begin_path(out_dir, step)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # a full disk (or quota, read-only file system) in any writer below: one OSError naming the
        # step and its folder (the CLI's one line, exit code 2), the previous checkpoints untouched
        with saving(f"the checkpoint of step {step}", final):
            os.makedirs(tmp)
            mdir = os.path.join(tmp, "model")
            if hasattr(model, "save_pretrained"):
                model.save_pretrained(mdir, safe_serialization=True, state_dict=model_state)
            else:
                os.makedirs(mdir)
                torch_save(model_state if model_state is not None else model.state_dict(),
                           os.path.join(mdir, "model.pt"))
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
            torch_save(state, os.path.join(tmp, "state.pt"))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"step": step, "format": 2}, f)  # 2: with checksums.json
            write_checksums(tmp)  # last: it covers every file above, the other ranks' shards included
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


def atomic_write_text(path: str, text: str) -> None:
    """Write a small file (config.yaml, a pointer) as temp file + fsync + rename + fsync of the
    folder: readers see the old content or the new, never a torn one."""
    d = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(d)


def save_model_atomic(model, tokenizer, path: str, what: str = "the model", advice: Optional[str] = None,
                      **save_kwargs) -> str:
    """`model.save_pretrained(path)` (+ the tokenizer) that a kill -9 or ENOSPC at any moment
    leaves either the previous folder or none, never a half-written one: the folder is built as
    a temp sibling `.tmp-<name>-<pid>`, the marker (`fastgrpo_complete.json`: sha256 + size of
    every file) written last, fsynced, then renamed over `path` (the previous copy is swapped
    out and deleted). Temp folders of dead writers are removed first. A full disk is one OSError
    naming `path` and `what` ("the SFT model"; `advice`: what to do, fastgrpo.runs.folder.saving).
    Returns `path`."""
    path = os.path.abspath(path)
    parent, name = os.path.dirname(path), os.path.basename(path)
    os.makedirs(parent, exist_ok=True)
    for entry in os.listdir(parent):  # leftovers of killed saves of this folder
        for prefix in (f".tmp-{name}-", f".old-{name}-"):
            if entry.startswith(prefix):
                pid = entry[len(prefix):]
                if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                    old = os.path.join(parent, entry)
                    if prefix.startswith(".old") and not os.path.exists(path) and is_complete_model_dir(old):
                        os.rename(old, path)  # killed between the two renames: put it back
                    else:
                        shutil.rmtree(old, ignore_errors=True)
    tmp = os.path.join(parent, f".tmp-{name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with saving(what, path, advice):
            save_kwargs.setdefault("safe_serialization", True)
            model.save_pretrained(tmp, **save_kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            write_checksums(tmp, MODEL_MARKER)
            _fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        old = os.path.join(parent, f".old-{name}-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    _fsync_dir(parent)
    return path


def _prune(out_dir: str, keep_last: int, keep: str) -> None:
    ckpts = list_checkpoints(out_dir)
    doomed = [p for p in ckpts[:-keep_last] if p != keep and p != ckpts[-1]]
    for p in doomed:
        # rename first so that a kill during rmtree never leaves a step-… without its files
        trash = os.path.join(os.path.dirname(p), f".tmp-trash-{os.path.basename(p)}-{os.getpid()}")
        os.rename(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
