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
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

_NAME = re.compile(r"^step-(\d{8})$")
_OLD = re.compile(r"^step-(\d{8})\.old-(\d+)$")
CHECKSUMS = "checksums.json"  # in a checkpoint: sha256 + size of every other file, written last
MODEL_MARKER = "fastgrpo_complete.json"  # the same, in a model folder saved by save_model_atomic
logger = logging.getLogger("fastgrpo.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint or model folder that fails its integrity check or does not load; the message
    names the file."""


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
        if pid != os.getpid() and pid_alive(pid):
            continue
        final = os.path.join(root, f"step-{step:08d}")
        if os.path.exists(os.path.join(final, "meta.json")):
            shutil.rmtree(path, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)  # nothing complete there (a partial copy at most)
            os.rename(path, final)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(root: str, skip: str) -> List[str]:
    """Every regular file under root, as sorted relative paths (except `skip`)."""
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel != skip:
                out.append(rel)
    return sorted(out)


def write_checksums(root: str, name: str = CHECKSUMS) -> None:
    """Write `name` in `root`: the sha256 and size of every other file below it. Written last,
    it is the completeness marker too: a folder without it is not trusted."""
    files = {rel: {"sha256": _sha256(os.path.join(root, rel)), "bytes": os.path.getsize(os.path.join(root, rel))}
             for rel in _files(root, name)}
    with open(os.path.join(root, name), "w") as f:
        json.dump({"format": 1, "algorithm": "sha256", "files": files}, f, indent=0)


def _signature(root: str) -> Tuple:
    out = []
    for rel in _files(root, ""):
        st = os.stat(os.path.join(root, rel))
        out.append((rel, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(out)


# folder → signature (names, sizes, mtimes, inodes) when it last verified: resume verifies a
# checkpoint once although `latest_checkpoint` and `load_checkpoint` both ask
_VERIFIED: Dict[str, Tuple] = {}


def verify_dir(root: str, name: str = CHECKSUMS, hashes: bool = True) -> Optional[str]:
    """None when every file listed in `root/name` is there with its size (and, with `hashes`,
    its sha256); otherwise what is wrong, naming the file."""
    marker = os.path.join(root, name)
    try:
        with open(marker) as f:
            files = json.load(f)["files"]
        items = [(str(rel), int(v["bytes"]), str(v["sha256"])) for rel, v in files.items()]
    except FileNotFoundError:
        return f"{marker} is missing (the save did not finish)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{marker} is unreadable ({type(e).__name__}: {e})"
    key = os.path.abspath(root)
    try:
        sig = _signature(root)
    except OSError as e:
        return f"{root}: {e}"
    if hashes and _VERIFIED.get(key) == sig:
        return None
    for rel, size, digest in items:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            return f"{path} is missing"
        got = os.path.getsize(path)
        if got != size:
            return f"{path} is {'truncated' if got < size else 'longer than saved'} ({got} bytes, saved {size})"
    if hashes:
        for rel, size, digest in items:
            path = os.path.join(root, rel)
            if _sha256(path) != digest:
                return f"{path} does not match its sha256 (saved {digest[:16]}…): changed or damaged after the save"
        _VERIFIED[key] = sig
    return None


def verify_checkpoint(path: str) -> Optional[str]:
    """None when checkpoint `path` is intact, else the reason naming the file. A checkpoint
    saved before checksums existed is checked by loading its state and weights."""
    meta = os.path.join(path, "meta.json")
    try:
        with open(meta) as f:
            fmt = int(json.load(f).get("format", 1))
    except FileNotFoundError:
        return f"{meta} is missing (not a complete checkpoint)"
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"{meta} is unreadable ({type(e).__name__}: {e})"
    if fmt >= 2 or os.path.exists(os.path.join(path, CHECKSUMS)):
        return verify_dir(path)
    try:
        load_torch_file(os.path.join(path, "state.pt"))
        load_model_state(path)
    except CheckpointError as e:
        return str(e)
    return None


def latest_checkpoint(out_dir: str, log: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The newest checkpoint of `out_dir` that verifies; each newer one that does not is
    skipped with a message (to `log`, else the `fastgrpo.checkpoint` logger) naming its bad
    file. None when there is no checkpoint; CheckpointError when none of them verifies."""
    ckpts = list_checkpoints(out_dir)
    skipped = []
    for path in reversed(ckpts):
        why = verify_checkpoint(path)
        if why is None:
            return path
        skipped.append(why)
        msg = f"[fastgrpo] checkpoint {path} skipped: {why}; trying the one before"
        (log or logger.warning)(msg)
    if ckpts:
        raise CheckpointError(f"{ckpt_root(out_dir)}: none of the {len(ckpts)} checkpoints verifies "
                              f"({'; '.join(skipped)}); move them aside to start over, or restore one")
    return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a folder or lock of a dead writer is stale)."""
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
        if pid != os.getpid() and (pid < 0 or not pid_alive(pid)):
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
    if not os.path.isdir(root):
        os.makedirs(root, exist_ok=True)
        _fsync_dir(out_dir)  # the new checkpoints/ entry itself survives a power cut
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


def is_complete_model_dir(path: str, verify: bool = False) -> bool:
    """True when `path` is a model folder written completely by `save_model_atomic`: its marker
    lists every file with its size (and, with `verify`, its sha256), config.json among them. A
    folder torn by a kill or a full disk, or saved by something else, is not complete."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return verify_dir(path, MODEL_MARKER, hashes=verify) is None


def save_model_atomic(model, tokenizer, path: str, **save_kwargs) -> str:
    """`model.save_pretrained(path)` (+ the tokenizer) that a kill -9 or ENOSPC at any moment
    leaves either the previous folder or none, never a half-written one: the folder is built as
    a temp sibling `.tmp-<name>-<pid>`, the marker (`fastgrpo_complete.json`: sha256 + size of
    every file) written last, fsynced, then renamed over `path` (the previous copy is swapped
    out and deleted). Temp folders of dead writers are removed first. Returns `path`."""
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


def load_torch_file(path: str, weights_only: bool = False):
    """torch.load on CPU; a missing or damaged file raises CheckpointError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # torn zip, pickle garbage, ...: name the file, not just torch's reason
        raise CheckpointError(f"{path} does not load ({type(e).__name__}: {e})") from e


def _safetensors_load(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # SafetensorError (header / size), OSError
        raise CheckpointError(f"{path} does not load ({type(e).__name__}: {e})") from e


def load_model_state(path: str) -> Dict[str, torch.Tensor]:
    """The model weights of a checkpoint directory as a state dict."""
    mdir = os.path.join(path, "model")
    st = os.path.join(mdir, "model.safetensors")
    if os.path.exists(st):
        return _safetensors_load(st)
    index = os.path.join(mdir, "model.safetensors.index.json")
    if os.path.exists(index):  # save_pretrained shards models over its max_shard_size
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is unreadable ({type(e).__name__}: {e})") from e
        state: Dict[str, torch.Tensor] = {}
        for name in files:
            state.update(_safetensors_load(os.path.join(mdir, name)))
        return state
    pt = os.path.join(mdir, "model.pt")
    if os.path.exists(pt):
        return load_torch_file(pt, weights_only=True)
    raise CheckpointError(f"checkpoint {path}: no model/model.safetensors, model/model.safetensors.index.json or "
                          "model/model.pt inside")


def load_checkpoint(path: str, model=None, optimizer=None, scheduler=None, curriculum=None,
                    restore_rng: bool = True, verify: bool = True) -> Dict[str, Any]:
    """Restore what is given from checkpoint `path`; returns the state dict (step, extra, …).
    The checkpoint is verified first (CheckpointError naming the bad file, nothing restored)."""
    if not os.path.exists(os.path.join(path, "meta.json")):
        raise CheckpointError(f"checkpoint {path!r}: not a complete checkpoint (no meta.json)")
    if verify:
        why = verify_checkpoint(path)
        if why is not None:
            raise CheckpointError(f"checkpoint {path}: {why}")
    state = load_torch_file(os.path.join(path, "state.pt"))
    weights = load_model_state(path) if model is not None else None
    if model is not None:
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
