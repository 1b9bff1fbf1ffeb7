"""The fenced code blocks of Markdown pages (README.md, docs/**/*.md) and what the tests do with
each, shared by tests/test_readme.py and tests/test_docs.py so a page's examples cannot drift from
the code:

- `python`: runs (in a scratch working folder), or is only compiled when marked `gpu` / `slow`;
- `yaml`: loads as a run config, as `fastgrpo train --config <block>` would (marked
  `not-a-config`: parsed only);
- `json`: parses;
- `bash` / `sh` / `shell`: every `fastgrpo` command (also after `torchrun -m fastgrpo.cli`,
  `deepspeed --module fastgrpo.cli`, `nsys profile …`) is parsed by the real argparse parser and
  its settings are loaded as the CLI loads them (a line with a `<placeholder>` is only parsed);
  marked `run`, it really runs with tiny settings added. A `python` script, `-m` module or
  `bash` script it names must exist, with each `--flag` it passes spelled in that script. Other
  programs must be on a short list of known tools;
- anything else (`text`, no language): not checked.

A marker is an HTML comment on the line right before the block: `<!-- docs-test: gpu -->`,
`<!-- docs-test: slow -->`, `<!-- docs-test: run -->`, `<!-- docs-test: not-a-config -->`, and
`<!-- docs-test: file=NAME -->`, which also writes the block to NAME in the page's scratch folder
so that later blocks of the page (`--config NAME`, `NAME:function`) find it.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)[^\n]*$")
_MARK = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
RUN_OVERRIDES = ("steps=2", "sft.steps=2", "eval.max_problems=8", "rollout.prompts_per_step=4",
                 "logging.plots=false", "logging.tensorboard=false", "logging.progress=false")
# programs a bash block may name besides fastgrpo, python and the repository's scripts
KNOWN_TOOLS = {"pip", "pip3", "git", "ray", "wandb", "nsys", "ncu", "nvidia-smi", "cd", "export", "mkdir", "source",
               ".", "mkdocs", "tensorboard", "ls", "cat", "echo", "curl", "docker"}


@dataclass
class Block:
    source: str  # the page, relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    heading: str  # the nearest heading above
    marks: Dict[str, str] = field(default_factory=dict)  # marker → value ("" for a flag)

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}:{self.lang or 'text'}"


def blocks(text: str, source: str = "") -> List[Block]:
    """The fenced blocks of a Markdown text, in order."""
    out: List[Block] = []
    lines = text.splitlines()
    heading, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        m = _FENCE.match(line)
        if not m:
            i += 1
            continue
        fence, indent = m.group("fence"), m.group("indent")
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        code = "\n".join(x[len(indent):] if x.startswith(indent) else x for x in lines[i + 1:j]) + "\n"
        marks: Dict[str, str] = {}
        k = i - 1
        while k >= 0 and _MARK.search(lines[k]):
            for item in _MARK.search(lines[k]).group(1).split():
                key, _, value = item.partition("=")
                marks[key] = value
            k -= 1
        out.append(Block(source, i + 1, m.group("lang").lower(), code, heading, marks))
        i = j + 1
    return out


def section(text: str, heading: str) -> str:
    """The text under the heading whose title starts with `heading` (any level), up to the next
    heading of the same or a higher level."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(#+)\s+(.*)$", line)
        if m and m.group(2).strip().startswith(heading):
            level = len(m.group(1))
            end = next((j for j in range(i + 1, len(lines)) if re.match(r"^#{1,%d}\s" % level, lines[j])), len(lines))
            return "\n".join(lines[i + 1:end]) + "\n"
    raise AssertionError(f"no heading {heading!r}")


def first_block(text: str, lang: str) -> str:
    """The code of the first `lang` block of `text`."""
    for b in blocks(text):
        if b.lang == lang:
            return b.code
    raise AssertionError(f"no {lang} block")


def page_blocks(path: pathlib.Path) -> List[Block]:
    return blocks(path.read_text(), str(path.relative_to(ROOT)))


def write_files(page: Sequence[Block], folder: pathlib.Path) -> Dict[str, pathlib.Path]:
    """The page's `file=NAME` blocks, written into `folder`."""
    files = {}
    for b in page:
        name = b.marks.get("file")
        if name:
            path = folder / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.code)
            files[name] = path
    return files


# ---------------------------------------------------------------------------------------------
# what each kind of block does
# ---------------------------------------------------------------------------------------------


def check_block(block: Block, workdir: pathlib.Path, files: Optional[Dict[str, pathlib.Path]] = None) -> dict:
    """Run / load / parse one block; raises AssertionError (or the block's own error) when it does
    not hold. `workdir` is a scratch folder (python blocks run in it); returns what was produced
    (a python block's namespace, a yaml block's config, a json block's value)."""
    files = files or {}
    if block.lang == "python":
        return run_python(block, workdir)
    if block.lang in ("yaml", "yml"):
        if "not-a-config" in block.marks:
            import yaml

            return {"value": yaml.safe_load(block.code)}
        return {"config": load_yaml_config(block.code, workdir)}
    if block.lang == "json":
        return {"value": json.loads(block.code)}
    if block.lang in ("bash", "sh", "shell", "console"):
        check_bash(block, workdir, files)
        return {}
    return {}


def run_python(block: Block, workdir: pathlib.Path) -> dict:
    code = compile(block.code, block.id, "exec")
    if "gpu" in block.marks or "slow" in block.marks:
        return {}
    ns: dict = {"__name__": "__docs__"}
    old = os.getcwd()
    os.chdir(workdir)
    try:
        exec(code, ns)
    finally:
        os.chdir(old)
    return ns


def load_yaml_config(text: str, workdir: pathlib.Path, name: str = "block.yaml"):
    """The run config `fastgrpo train --config <text>` would build (the demo's settings under a
    partial file for the tiny model, the library defaults under a model of your own)."""
    path = workdir / name
    path.write_text(text)
    return load_cli_config(["train", "--config", str(path)], workdir)


def load_cli_config(argv: List[str], workdir: pathlib.Path):
    """Parse `fastgrpo <argv>` and build its run config exactly as the CLI does, without running."""
    from fastgrpo import cli

    args = cli.build_parser().parse_args(argv)
    if getattr(args, "out", None) is None:
        args.out = str(workdir / "run")
    cfg, _source, _unused = cli.config_from_args(args)
    return cfg


def _commands(code: str) -> List[List[str]]:
    """The commands of a bash block: continuations joined, comments dropped, split on && ; |."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: List[str] = []
        for tok in lexer:
            if tok and set(tok) <= set(";&|"):
                if current:
                    out.append(current)
                current = []
            else:
                current.append(tok)
        if current:
            out.append(current)
    return out


def _strip_env(cmd: List[str]) -> List[str]:
    while cmd and re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]):
        cmd = cmd[1:]
    return cmd


def _fastgrpo_argv(cmd: List[str]) -> Optional[List[str]]:
    """The arguments after `fastgrpo` in a command, or None when it runs no fastgrpo command."""
    if cmd[0] == "fastgrpo" or cmd[0].endswith("/fastgrpo"):
        return cmd[1:]
    for flag in ("-m", "--module"):  # torchrun -m fastgrpo.cli, deepspeed --module fastgrpo.cli, python -m fastgrpo.cli
        if flag in cmd:
            i = cmd.index(flag)
            if i + 1 < len(cmd) and cmd[i + 1] in ("fastgrpo.cli", "fastgrpo"):
                return cmd[i + 2:]
    if cmd[0] == "nsys" and "fastgrpo" in cmd:
        return cmd[cmd.index("fastgrpo") + 1:]
    return None


def check_fastgrpo(argv: List[str], workdir: pathlib.Path, files: Dict[str, pathlib.Path], run: bool = False):
    """A `fastgrpo` command line of the docs: parsed, its settings loaded (or run, tiny)."""
    from fastgrpo import cli

    argv = [str(files[a]) if a in files else a for a in argv]
    if not argv or argv[0].startswith("-") and argv[0] not in ("--version", "-h", "--help"):
        argv = ["train"] + argv
    parser = cli.build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        if argv[0] in ("--version", "-h", "--help") and not e.code:
            return
        raise AssertionError(f"`fastgrpo {' '.join(argv)}` does not parse (exit {e.code})") from None
    if args.command not in cli.COMMANDS or any(re.search(r"<[^>]+>", a) for a in argv):
        return  # env / export / --version run nothing to load; a <placeholder> cannot load
    if run:
        out = workdir / f"run-{args.command}"
        argv = [a for a in argv]
        if "--out" in argv:
            argv[argv.index("--out") + 1] = str(out)
        else:
            argv += ["--out", str(out)]
        for o in RUN_OVERRIDES:
            argv += ["--set", o]
        rc = cli.main(argv)
        assert rc == 0, f"`fastgrpo {' '.join(argv)}` exited {rc}"
        return
    load_cli_config(argv, workdir)


def _script_flags_exist(path: pathlib.Path, cmd: List[str], what: str):
    source = path.read_text() if path.is_file() else "".join(p.read_text() for p in path.rglob("*.py"))
    for tok in cmd:
        flag = tok.split("=", 1)[0]
        if re.fullmatch(r"--[a-z][\w-]*", flag):
            assert f'"{flag}"' in source or f"'{flag}'" in source or re.search(rf"\b{re.escape(flag)}\b", source), (
                f"{what}: {path.relative_to(ROOT)} takes no {flag}")


def _module_path(module: str) -> Optional[pathlib.Path]:
    base = ROOT.joinpath(*module.split("."))
    for p in (base.with_suffix(".py"), base / "__main__.py", base / "__init__.py"):
        if p.is_file():
            return p
    return None


def check_command(cmd: List[str], workdir: pathlib.Path, files: Dict[str, pathlib.Path], run: bool = False,
                  where: str = ""):
    cmd = _strip_env(cmd)
    if not cmd:
        return
    argv = _fastgrpo_argv(cmd)
    if argv is not None:
        check_fastgrpo(argv, workdir, files, run=run)
        return
    prog = os.path.basename(cmd[0])
    if prog in ("torchrun", "deepspeed"):
        raise AssertionError(f"{where}: `{' '.join(cmd)}` launches no fastgrpo command")
    if re.fullmatch(r"python[\d.]*", prog):
        if len(cmd) > 2 and cmd[1] == "-m":
            if cmd[2] in ("venv", "pip", "pytest"):
                return
            path = _module_path(cmd[2])
            assert path is not None, f"{where}: no module {cmd[2]} in the repository"
            _script_flags_exist(path if path.name != "__init__.py" else path.parent, cmd[3:], where)
            return
        script = next((a for a in cmd[1:] if not a.startswith("-")), None)
        assert script and (ROOT / script).is_file(), f"{where}: no script {script} in the repository"
        _script_flags_exist(ROOT / script, cmd[2:], where)
        return
    if prog in ("bash", "sh"):
        script = cmd[1]
        assert (ROOT / script).is_file(), f"{where}: no script {script} in the repository"
        _script_flags_exist(ROOT / script, cmd[2:], where)
        return
    if cmd[0] == "./run":
        assert (ROOT / "run").is_file()
        sub = cmd[1] if len(cmd) > 1 else "train"
        if sub != "test":
            check_fastgrpo(cmd[1:], workdir, files, run=False)
        return
    assert prog in KNOWN_TOOLS, f"{where}: unknown program {cmd[0]!r} (a typo, or add it to doc_blocks.KNOWN_TOOLS)"


def check_bash(block: Block, workdir: pathlib.Path, files: Optional[Dict[str, pathlib.Path]] = None):
    """Each command of a bash block, checked from the repository root (where the docs' relative
    paths point); a `run` block's fastgrpo commands write only under `workdir`."""
    old = os.getcwd()
    os.chdir(ROOT)
    try:
        for cmd in _commands(block.code):
            check_command(cmd, workdir, files or {}, run="run" in block.marks and not
                          ("gpu" in block.marks or "slow" in block.marks), where=block.id)
    finally:
        os.chdir(old)


_INLINE_CMD = re.compile(r"`((?:[A-Z_]+=\S+ )*(?:python|\.venv/bin/python|bash) [^`]+)`")


def inline_commands(text: str) -> List[str]:
    """Commands quoted inline that run a script of the repository (`python -m benchmarks.bench_x
    --flag`, `bash benchmarks/gpu_suite.sh`), to check like a bash line."""
    return [m.group(1) for m in _INLINE_CMD.finditer(text)
            if "…" not in m.group(1) and re.search(r"benchmarks[./]|examples/", m.group(1))]
