"""Reading side of fastgrpo checkpoints: listing, integrity check, "latest" selection, restore.

The writer (`fastgrpo.runs.checkpoint`, which re-exports every name here) leaves
`<out>/checkpoints/step-NNNNNNNN/` complete or absent; this module decides which of them to trust.
A checkpoint is trusted when its `checksums.json` (sha256 and size of every other file, written
last) matches the files — the integrity scheme of a content-addressed store reduced to one manifest
per folder: a flipped byte or a truncated file is caught before it is trained on. Sizes are compared
first (cheap: a truncated file is named without hashing); a folder that verified once is not hashed
again while its names, sizes, mtimes and inodes are unchanged (`_VERIFIED`), so resume hashes each
byte once although `latest_checkpoint` and `load_checkpoint` both ask. Checkpoints saved before
checksums existed (meta.json format 1) are checked by loading them instead.

Departure from HF Trainer / DeepSpeed: "latest" is the newest complete `step-…` directory that
verifies, not a pointer file; each newer one that does not is skipped with a message naming its
bad file. torch / safetensors load errors become `CheckpointError` (a ValueError) naming the file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
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


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a folder or lock of a dead writer is stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def swapped_out(root: str):
    """(step, path, pid) of every `step-NNNNNNNN.old-<pid>` directory (a re-save's old copy)."""
    for name in os.listdir(root):
        m = _OLD.match(name)
        if m and os.path.exists(os.path.join(root, name, "meta.json")):
            yield int(m.group(1)), os.path.join(root, name), int(m.group(2))


def _orphaned_swaps(root: str):
    """Swapped-out copies whose step directory is missing (a re-save killed between its
    renames, or one in progress right now): (step, path). Whatever the pid — a restarted
    container often gets the same one — the copy is complete, and that step's only one."""
    for step, path, _ in swapped_out(root):
        if not os.path.exists(os.path.join(root, f"step-{step:08d}", "meta.json")):
            yield step, path


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
    root = ckpt_root(out_dir)
    # a step folder without meta.json (deleted, or damaged) is not listed; it is still newer and is said
    listed = {os.path.basename(p) for p in ckpts}
    unlisted = [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else [])
                if _NAME.match(n) and n not in listed and os.path.isdir(os.path.join(root, n))]
    ckpts = sorted(ckpts + unlisted, key=lambda p: int(re.search(r"step-(\d{8})", os.path.basename(p)).group(1)))
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


def is_complete_model_dir(path: str, verify: bool = False) -> bool:
    """True when `path` is a model folder written completely by `save_model_atomic`: its marker
    lists every file with its size (and, with `verify`, its sha256), config.json (a LoRA policy's
    adapter folder: adapter_config.json) among them. A folder torn by a kill or a full disk, or
    saved by something else, is not complete."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
        return False
    return verify_dir(path, MODEL_MARKER, hashes=verify) is None


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
