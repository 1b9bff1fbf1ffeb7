"""mkdocs-gen-files script: the reference pages that are read from the code (docs/reference_data.py),
written at build time so that they cannot drift: reference/config.md (every field of the run
configuration), reference/cli.md (every command and flag, the FASTGRPO_* knobs) and
reference/api.md (the public names, rendered by mkdocstrings)."""
from __future__ import annotations

import html
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_data as ref  # noqa: E402

GENERATED = ("!!! note \"Generated\"\n    This page is written from the code at build time by `docs/gen_ref.py` "
             "({}); edit the source, not this page.\n\n")


def cell(text: str) -> str:
    """Markdown table cell: code spans kept, everything else HTML-escaped, pipes escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for p in parts:
        if p.startswith("`") and p.endswith("`") and len(p) > 1:
            out.append(p.replace("|", "\\|"))
        else:
            out.append(html.escape(p, quote=False).replace("|", "&#124;").replace("*", "\\*").replace("_", "\\_"))
    return "".join(out).replace("\n", " ")


def anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "top-level"


def config_page() -> str:
    lines = ["# Configuration reference", "",
             GENERATED.format("the dataclasses of `fastgrpo/config/schema.py` with their comments, and the checks "
                              "of the config loader"),
             "Every field can be set in a YAML file (`--config run.yaml`, one mapping per section) or on the "
             "command line (`--set section.field=value`, the value read as YAML). An unknown field or an invalid "
             "value stops the run at load time with one line naming the field. Settings are layered: library "
             "defaults ← the embedded demo (only for the tiny demo model) ← `--config` ← `--set`; "
             "see [Getting started](../getting-started.md#settings-and-overrides).", "",
             "The *valid* column lists what the loader checks (ranges, choices and the checks between fields); "
             "`…` stands for a value known only at run time.", ""]
    from fastgrpo.config import REWARD_NAMES

    for s in ref.config_sections():
        title = f"`{s.path}`" if s.path else "Top level"
        lines += [f"## {title} {{#{anchor(s.path)}}}", ""]
        if s.doc:
            lines += [cell(s.doc[0].upper() + s.doc[1:]), ""]
        if s.path.endswith("<name>"):
            lines += ["A mapping: each entry's key is its name (listed in `rewards.functions` like a built-in "
                      "reward), its value a section with the fields below.", ""]
        if not s.fields:
            continue
        lines += ["| field | type | default | meaning | valid |", "|---|---|---|---|---|"]
        for f in s.fields:
            valid = "; ".join(f.valid)
            lines.append(f"| `{f.path}` | `{f.type}` | `{f.default}` | {cell(f.comment)} | {cell(valid)} |")
        lines.append("")
        if s.path == "rewards":
            lines += ["### Built-in rewards {#built-in-rewards}", "", "| name | what it scores |", "|---|---|"]
            lines += [f"| `{n}` | {cell(d)} |" for n, d in REWARD_NAMES.items()]
            lines += ["", "Any other entry of `rewards.functions` is a reward model of `rewards.models` or your "
                      "function as `module:function` / `file.py:function` "
                      "(see [Rewards and verifiers](../guides/rewards.md))."]
            lines.append("")
    return "\n".join(lines)


def cli_page() -> str:
    lines = ["# Command-line reference", "", GENERATED.format("the argparse parser of `fastgrpo/cli.py`"),
             "`fastgrpo` with no subcommand runs `fastgrpo train` (the embedded demo). `./run <command>` runs the "
             "same commands from a fresh checkout. Every command that trains or evaluates takes the same settings "
             "options; the run's fields are listed in the [configuration reference](config.md).", ""]
    for c in ref.cli_commands():
        name = f"fastgrpo {c.name}".strip()
        lines += [f"## `{name}` {{#{anchor(name)}}}", ""]
        if c.help:
            lines += [cell(c.help[0].upper() + c.help[1:]) + ".", ""]
        lines += ["```text", c.usage, "```", ""]
        if c.options:
            lines += ["| option | meaning | default |", "|---|---|---|"]
            for o in c.options:
                lines.append(f"| `{o.flags}` | {cell(o.help)}{' (required)' if o.required else ''} | "
                             f"{cell(o.default)} |")
            lines.append("")
        if c.epilog:
            page = re.search(r"docs/([\w/.-]+\.md)", c.epilog)
            if page:
                lines += [f"Guide: [{page.group(1)}](../{page.group(1)})", ""]
    lines += ["## Exit codes {#exit-codes}", "",
              "See [Errors and exit codes](errors.md#exit-codes).", "",
              "## Environment variables {#environment-variables}", "",
              "Every `FASTGRPO_*` variable, read in `fastgrpo/env.py`:", "",
              "| variable | effect |", "|---|---|"]
    lines += [f"| `{name}` | {cell(doc)} |" for name, doc in ref.env_knobs()]
    lines.append("")
    return "\n".join(lines)


def api_page() -> str:
    lines = ["# Python API", "", GENERATED.format("`fastgrpo.__all__` and the docstrings"),
             "Every name below imports from the package root (`from fastgrpo import grpo_loss`); the heading of "
             "each group is the module that exports it. The loss kernels live in `kernels/`, installed as "
             "`fastgrpo.kernels`.", ""]
    current = None
    for o in ref.api_objects():
        if o.exported_from != current:
            current = o.exported_from
            lines += [f"## `{current}`", ""]
        lines += [f"::: {o.identifier}", "    options:", "      heading_level: 3", ""]
    return "\n".join(lines)


PAGES = {"reference/config.md": config_page, "reference/cli.md": cli_page, "reference/api.md": api_page}


def main() -> None:
    import mkdocs_gen_files

    for name, page in PAGES.items():
        with mkdocs_gen_files.open(name, "w") as f:
            f.write(page())


if __name__ in ("__main__", "<run_path>"):  # mkdocs-gen-files runs this file with runpy.run_path
    main()
