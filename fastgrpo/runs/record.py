"""The run folder's record of its settings, kept across resumes.

`<run>/config.yaml` holds the settings the run started with and is never rewritten by a resume.
A resume (a run started again on a folder that has a GRPO checkpoint or a saved SFT model)
compares its settings with the run's newest record *before anything is written*:

- a change the saved state cannot take — the model's shape or origin (`model.path`, `arch`,
  `hidden_size`, `num_hidden_layers`, `intermediate_size`, `num_attention_heads`, `model.lora.*`),
  the task or its problems (every `data.*` field but the prompt's and the answer's format:
  `system_prompt`, `chat_template`, `enable_thinking`, `answer_format`, `answer_tag`,
  `max_prompt_tokens`) — is refused with one ValueError line naming each changed field,
  old → new; nothing in the folder changes;
- any other change (a learning rate, the group size, more steps, …) is said in one line naming
  each field, old → new, and recorded as `config.resume-<step>.yaml` (the full settings the run
  continued with from GRPO step <step>; a second resume at the same step adds `-2`, `-3`, …). The
  newest record is what the next resume compares with. It is written once the checkpoint took
  the settings (`fastgrpo.pipeline`), so a resume refused later leaves no record behind.

Settings that only say where and how to log (`logging.out_dir`, `logging.progress`,
`checkpoint.resume`) are not compared. A field that the stored record does not have (a setting
added to fastgrpo since the run began) is not compared either. Departure from HF Trainer,
which takes the new arguments silently, and from Lightning, which restores the stored
hyperparameters over the new ones: the run says what changed and keeps both.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

FIRST = "config.yaml"
_RESUMED = re.compile(r"^config\.resume-(\d{8})(?:-(\d+))?\.yaml$")
# the saved weights, optimizer and curriculum state belong to these: a resume cannot change them
# and every data.* field that decides which problems there are and their ids (the checkpoint's
# curriculum holds them): all of data.* but how a prompt is written and an answer read
FIXED = ("model.path", "model.arch", "model.hidden_size", "model.num_hidden_layers", "model.intermediate_size",
         "model.num_attention_heads", "model.lora.", "data.")
FREE_DATA = ("data.system_prompt", "data.chat_template", "data.enable_thinking", "data.answer_format", "data.answer_tag",
             "data.max_prompt_tokens")
IGNORED = ("logging.out_dir", "logging.progress", "checkpoint.resume")


def _flat(data: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(data, dict):
        out: Dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): list(data) if isinstance(data, tuple) else data}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def records(out_dir: str) -> List[str]:
    """The run's settings records, oldest first: config.yaml, then config.resume-*.yaml by step."""
    found: List[Tuple[int, int, str]] = []
    if os.path.isfile(os.path.join(out_dir, FIRST)):
        found.append((-1, 0, FIRST))
    try:
        names = os.listdir(out_dir)
    except OSError:
        names = []
    for name in names:
        m = _RESUMED.match(name)
        if m:
            found.append((int(m.group(1)), int(m.group(2) or 1), name))
    return [os.path.join(out_dir, n) for _, _, n in sorted(found)]


def has_saved_state(out_dir: str) -> bool:
    """A GRPO checkpoint or a saved SFT model: something a resume would continue from."""
    from fastgrpo.runs.checkpoint import list_checkpoints

    return bool(list_checkpoints(out_dir)) or os.path.isdir(os.path.join(out_dir, "sft", "model"))


@dataclass
class ResumePlan:
    """What starting `cfg` on its run folder will do to the settings record."""

    resume: bool  # the folder has a record and saved state, and checkpoint.resume is not none
    against: Optional[str] = None  # the record compared with
    changes: List[Tuple[str, Any, Any]] = field(default_factory=list)  # (field, old, new)

    def describe(self) -> str:
        return ", ".join(f"{k} {old!r} → {new!r}" for k, old, new in self.changes)


def plan_resume(cfg) -> ResumePlan:
    """Compare `cfg` with its run folder's newest record; nothing is written. Raises ValueError
    naming every changed field the saved state cannot take."""
    from fastgrpo.config import to_dict

    out = cfg.logging.out_dir
    recs = records(out)
    if cfg.checkpoint.resume == "none" or not recs or not has_saved_state(out):
        return ResumePlan(resume=False)
    latest = recs[-1]
    try:
        with open(latest) as f:
            stored = yaml.safe_load(f)
        if not isinstance(stored, dict):
            raise ValueError(f"not a mapping ({type(stored).__name__})")
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ValueError(f"{latest}: the run's record of its settings does not read ({e}); restore it, or give this "
                         "run another --out folder") from None
    old, new = _flat(stored), _flat(to_dict(cfg))
    changes = [(k, old[k], v) for k, v in new.items()
               if k in old and not k.startswith(IGNORED) and not _same(old[k], v)]
    fixed = [c for c in changes if c[0].startswith(FIXED) and not c[0].startswith(FREE_DATA)]
    if fixed:
        named = ", ".join(f"{k} {o!r} → {n!r}" for k, o, n in fixed)
        raise ValueError(f"run folder {out}: {named} differ{'s' if len(fixed) == 1 else ''} from the run's own settings "
                         f"({os.path.basename(latest)}); its saved model and state cannot continue with "
                         f"{'that' if len(fixed) == 1 else 'those'} — resume with the run's settings, or give the "
                         "new settings another --out folder")
    return ResumePlan(resume=True, against=latest, changes=changes)


def write_record(cfg, plan: ResumePlan, step: int, log: Callable[[str], None]) -> Optional[str]:
    """config.yaml for a new run; for a resume with changes, config.resume-<step>.yaml (said in
    one line); nothing for a resume without changes. Returns the path written."""
    from fastgrpo.config import dump_config

    out = cfg.logging.out_dir
    if not plan.resume:
        path = os.path.join(out, FIRST)
        dump_config(cfg, path)  # temp file + rename (fastgrpo.config.dump_config)
        return path
    if not plan.changes:
        return None
    base = os.path.join(out, f"config.resume-{step:08d}")
    path, n = f"{base}.yaml", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.yaml"
    dump_config(cfg, path)
    log(f"[fastgrpo] resuming with changed settings: {plan.describe()} (recorded in {os.path.basename(path)}; "
        f"{FIRST} keeps the run's first settings)")
    return path
