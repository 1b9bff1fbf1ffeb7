"""Where a run's settings come from, and `--set`s that would change nothing.

A run's config is layered: the library defaults (fastgrpo/config/schema.py) ← the embedded demo
(fastgrpo/demo/default.py, for the tiny demo model only) ← a `--config` file ← `--set` overrides.
`describe_layers` turns those layers into the one start-up line that says which fields each
layer set (the file's and `--set`'s by name), so a partial config file never drops the demo's
settings unseen. `inert_overrides` names a `--set` that the resulting run would ignore (an
`sft.*` field when the SFT cold start is off, …): the CLI says so in one line at start instead of
running without it unseen. This follows the "show origin" of git config (`git config --show-origin`); departure: one
summary line per run instead of one line per key.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

# field prefix → (the switch that must be on for it to act, its value that turns it on, commands where it acts anyway)
_GATES = {
    "sft.": ("sft_first", True, ("sft",)),
    "rm_stage.": ("rm_stage.steps", "> 0", ()),
    "fusion.": ("fusion.enabled", True, ("fuse",)),
}


def flatten(data: Any, prefix: str = "") -> Dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}; a non-dict value is a leaf."""
    if not isinstance(data, dict) or not data:
        return {prefix.rstrip("."): data} if prefix else {}
    out: Dict[str, Any] = {}
    for k, v in data.items():
        out.update(flatten(v, f"{prefix}{k}."))
    return out


def _names(keys: List[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", +{len(keys) - limit} more" if len(keys) > limit else "")


def describe_layers(layers: Sequence[Tuple[str, Optional[Dict[str, Any]]]]) -> str:
    """One line: each layer with the fields it sets that no later layer overrides.

    `layers`: (name, nested dict of the fields it sets) from first to last; the first is the
    library defaults (its dict may be None: every field not set later)."""
    flat = [(name, flatten(d or {})) for name, d in layers]
    parts = []
    for i, (name, fields) in enumerate(flat):
        later = set().union(*[f for _, f in flat[i + 1:]]) if i + 1 < len(flat) else set()
        own = sorted(k for k in fields if k not in later)
        if i == 0:
            parts.append(name)
        elif fields:
            named = "" if name.startswith("the embedded demo") else f": {_names(own)}"
            parts.append(f"{name} ({len(own)} field{'s' if len(own) != 1 else ''}{named})")
    return " ← ".join(parts)


def inert_overrides(cfg, overrides: Sequence[str], command: str) -> List[str]:
    """One line for each `--set` that the run `cfg` of `command` would not use (empty when every
    one acts)."""
    from fastgrpo.config.load import parse_override

    lines = []
    for item in overrides:
        keys, _ = parse_override(item)
        path = ".".join(keys)
        for prefix, (switch, on, always) in _GATES.items():
            if not path.startswith(prefix) or path == switch or command in always:
                continue
            value = cfg
            for part in switch.split("."):
                value = getattr(value, part)
            active = bool(value) if on is True else value > 0
            if not active:
                want = f"--set {switch}=true" if on is True else f"--set {switch}=<steps>"
                shown = str(value).lower() if isinstance(value, bool) else value
                lines.append(f"--set {item} has no effect in this run: {switch}={shown}; add {want} to use it")
    return lines
