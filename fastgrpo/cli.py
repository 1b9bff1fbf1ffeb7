"""`fastgrpo` command line: train | sft | eval | bench | fuse | env | export.

Each subcommand builds a `TrainConfig` (the library defaults ← the embedded demo, for the tiny
demo model ← --config ← --set; the first line printed says what came from where) and calls one
library function of fastgrpo.pipeline; nothing else happens here (house style rule 5).

    fastgrpo train                                  # the embedded demo, end to end
    fastgrpo train --demo tools                     # its tool variant: products with a calculator tool
    fastgrpo train --config run.yaml --set optimizer.lr=1e-4 --out runs/a
    fastgrpo sft --set sft.steps=500
    fastgrpo eval --set model.path=runs/a           # held-out accuracy, pass@k (eval.num_samples) with runs/a's settings; no model.path: refused
    fastgrpo bench --set steps=10                   # median seconds per phase, tokens/s
    fastgrpo fuse --set model.path=runs/a           # thinking-mode fusion of a trained run + budget sweep
    fastgrpo env                                    # versions, devices, native builds: paste into a bug report
    fastgrpo export --merge runs/a merged/          # a LoRA run's adapter merged into its base: a plain HF folder
    fastgrpo train --config rm.yaml                 # with rm_stage.steps > 0: RLVR, then RM-GRPO in <out>/rm_stage
    fastgrpo train --nvtx                           # NVTX range per phase for `nsys profile`
    torchrun --nproc_per_node 2 -m fastgrpo.cli train --set distributed.backend=deepspeed
    deepspeed --num_gpus 2 --module fastgrpo.cli train --set distributed.backend=deepspeed

Under a multi-process launch only rank 0 prints (and draws the progress bar); the
`--local_rank=N` that the `deepspeed` launcher adds is accepted and ignored (the rank is read
from the launcher's LOCAL_RANK environment variable, fastgrpo.trainer.backend.launcher_env).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from typing import List, Optional

COMMANDS = ("train", "sft", "eval", "bench", "fuse")
# the guide page of each command (docs/, the MkDocs site); `--help` ends with it
DOCS_PAGES = {"": "index.md", "train": "getting-started.md", "sft": "guides/recipes.md",
              "eval": "guides/model-and-data.md", "bench": "guides/gpu.md", "fuse": "guides/recipes.md",
              "env": "guides/gpu.md", "export": "guides/lora.md"}


def _docs(command: str = "") -> str:
    """The `--help` epilog: the command's guide page, and where the reference of every flag is
    (docs/reference/cli.md is generated from this parser when the site builds)."""
    return (f"docs: docs/{DOCS_PAGES[command]}; every flag of every command: the docs site's "
            "Reference > Command line (`pip install -e \".[docs]\" && mkdocs serve`)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastgrpo", description="GRPO / RLVR training with fused kernels",
                                epilog=_docs())
    sub = p.add_subparsers(dest="command")
    for name, help_ in (("train", "SFT cold start + GRPO (+ held-out eval before and after)"),
                        ("sft", "the SFT cold start only"), ("eval", "held-out accuracy / pass@k of model.path"),
                        ("bench", "seconds per phase and tokens/s of a few GRPO steps"),
                        ("fuse", "thinking-mode fusion (Qwen3) of model.path + the thinking-budget sweep")):
        s = sub.add_parser(name, help=help_, epilog=_docs(name))
        s.add_argument("--config", help="YAML file of config sections (default: the embedded demo)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                       help="override one field, e.g. --set optimizer.lr=1e-4 (repeatable)")
        s.add_argument("--out", help="run folder (logging.out_dir); an existing one resumes")
        s.add_argument("--nvtx", action="store_true", help="emit an NVTX range per phase (Nsight Systems)")
        s.add_argument("--verbose", action="store_true",
                       help="show the libraries' logs (vLLM, transformers, …) instead of writing them to <run>/log.txt")
        s.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its one-line message")
        s.add_argument("--demo", choices=("default", "tools"), default="default",
                       help="the embedded demo the tiny model runs: default (sums) | tools (products with a calculator "
                            "tool, fastgrpo/demo/tools.py; its baseline: --set rollout.tools=[])")
        if name == "eval":
            s.add_argument("--untrained", action="store_true",
                           help="score the tiny demo model with random weights (refused without this flag "
                                "when model.path is not set)")
    e = sub.add_parser("env", help="versions, devices, native builds and a Triton compile check, for a bug report",
                       epilog=_docs("env"))
    e.add_argument("--quick", action="store_true", help="no builds and no compile check: only what is already known")
    x = sub.add_parser("export", help="a LoRA run's adapter merged into its base, as a plain HF folder",
                       epilog=_docs("export"))
    x.add_argument("--merge", action="store_true", required=True, help="merge the adapter into the base weights")
    x.add_argument("run", help="a LoRA run folder, one of its checkpoints, or a PEFT adapter folder")
    x.add_argument("folder", help="the HF folder to write (transformers and vLLM load it without PEFT): new or empty")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in folder (refused when it holds a file fastgrpo did not write)")
    x.add_argument("--debug", action="store_true", help="print the traceback of an error")
    import fastgrpo

    p.add_argument("--version", action="version", version=f"fastgrpo {fastgrpo.__version__}")
    return p


def _file_settings(path: Optional[str]) -> dict:
    """The mapping in the YAML file `path` ({} when it does not read: load_config then reports why)."""
    if not path:
        return {}
    try:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f)
        return data if isinstance(data, dict) else {}
    except Exception:  # noqa: BLE001 — the real error comes from load_config, with its file and line
        return {}


def uses_demo(args) -> bool:
    """The embedded demo's settings apply when model.path (of --set, else of the --config file)
    is the demo's tiny model; a user's checkpoint starts from the library defaults
    (fastgrpo/config/schema.py: settings for a pretrained model). A partial --config for the tiny
    model (as the README's snippets are) thus changes the demo field by field, never drops it."""
    from fastgrpo.config import parse_override

    model = _file_settings(args.config).get("model")
    path = model.get("path", "tiny") if isinstance(model, dict) else "tiny"
    for item in args.overrides:
        keys, value = parse_override(item)
        if keys == ["model", "path"] or (keys == ["model"] and isinstance(value, dict) and "path" in value):
            path = value if keys == ["model", "path"] else value["path"]
    return path == "tiny"


def config_from_args(args):
    """TrainConfig of parsed args — the library defaults ← the embedded demo (for the tiny model)
    ← --config ← --set, --out, --nvtx —, the start-up line saying what came from where, and one
    line for each explicit --set that the run would not use (fastgrpo.config.sources)."""
    from fastgrpo.config import apply_overrides, load_config
    from fastgrpo.config.sources import describe_layers, inert_overrides
    from fastgrpo.demo.default import default_config, demo_settings

    overrides = list(args.overrides)
    if args.nvtx:
        overrides.append("logging.nvtx=true")
    out = args.out or f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    layers = [("library defaults", None)]
    config_path = args.config
    if not config_path and args.command in ("fuse", "eval"):  # a run folder's own settings (task, rollout, rewards) carry over
        from fastgrpo.recipes.fusion import run_config_path

        config_path = run_config_path(args.overrides)
        if config_path:
            layers.append((f"the RL run's config {config_path}", _file_settings(config_path)))
    elif config_path:
        layers.append((f"config file {config_path}", _file_settings(config_path)))
    demo = getattr(args, "demo", "default")
    if uses_demo(argparse.Namespace(config=config_path, overrides=args.overrides)):
        where = "fastgrpo/demo/default.py" + (" + fastgrpo/demo/tools.py" if demo == "tools" else "")
        layers.insert(1, (f"the embedded {'tool ' if demo == 'tools' else ''}demo {where}", demo_settings(demo)))
        cfg = default_config(overrides, out_dir=out, config_path=config_path, demo=demo)
    elif demo != "default":
        raise ValueError(f"--demo {demo}: the demos train the tiny model (model.path=tiny), not the model.path given")
    else:
        cfg = load_config(config_path, overrides + [f"logging.out_dir={out}"])
    layers.append(("--set", apply_overrides({}, overrides)))
    return cfg, describe_layers(layers), inert_overrides(cfg, args.overrides, args.command)


def strip_local_rank(argv: List[str]) -> List[str]:
    """argv without `--local_rank=N` / `--local_rank N` (also `--local-rank`): the deepspeed
    launcher inserts it before the user's arguments, where it would hide the subcommand."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--local_rank", "--local-rank"):
            skip = "=" not in a and i + 1 < len(argv) and argv[i + 1].lstrip("-").isdigit()
            continue
        out.append(a)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    """The command line (`argv`: its arguments; None: this process's own, `fastgrpo …` / `python -m
    fastgrpo.cli …`, which also owns the process: `_own_process`)."""
    if argv is None:
        return _own_process(lambda: main(sys.argv[1:]))
    from fastgrpo.trainer.backend import launcher_env

    argv = strip_local_rank(list(argv))
    try:
        rank = launcher_env().rank
    except ValueError as e:
        print(f"fastgrpo: {e}", file=sys.stderr)
        return 2
    main_rank = rank == 0

    def log(*a, **k):  # every rank computes the same thing: one copy of the output is enough
        if main_rank:
            print(*a, **k)

    if argv and argv[0] in ("env", "--version"):
        return _info(argv)
    if argv and argv[0] == "export":
        return _export(argv, log)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["train"] + argv  # `fastgrpo` alone (or with options only) runs the demo
    args = build_parser().parse_args(argv)
    try:
        cfg, source, unused = config_from_args(args)
        out = cfg.logging.out_dir
        if os.path.exists(out) and not os.path.isdir(out):
            raise ValueError(f"{'--out' if args.out else 'logging.out_dir'} {out}: is a file, not a folder; give a new "
                             "or existing run folder")
    except Exception as e:  # noqa: BLE001 — every expected failure of the config is one line
        return _fail(e, args, log)
    from fastgrpo.runs.folder import restore_compiler_cache, route_compiler_cache

    existed = os.path.isdir(out)
    old_cache = route_compiler_cache(out)  # before transformers imports torch._dynamo, which creates the cache folder
    try:
        return _run(args, cfg, source, unused, log, main_rank, existed)
    finally:
        restore_compiler_cache(old_cache, out)  # and its folder, when nothing was compiled into it


def _own_process(command) -> int:
    """`command()` as the process's program. A signal at any moment ends it with 128 + the signal's
    number: during a run as the run's own handling says (fastgrpo.runs.folder.graceful_signals),
    outside it (the config's load, the return after the run's last line) at once with one line
    saying where (`last_where`), and once the command has returned as the signal's default action
    (nothing more to say) — never raised into the interpreter's exit as a traceback, nor lost after
    the last Python code ran (rc 0). A run a signal stops ends within STOP_GRACE_S even when its
    cleanup blocks (`exit_deadline`). A library caller of `main(argv)` keeps its own handlers."""
    import signal

    from fastgrpo.runs.folder import SIGNALS, exit_deadline, interrupted_line, last_where, stop_at_once

    def default_signals():
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)

    def stop(signum, frame):  # outside a run's own handling (config, the tail after it): at once, saying where
        default_signals()
        raise stop_at_once(signum, last_where())

    exit_deadline(True)
    for s in SIGNALS:
        signal.signal(s, stop)
    try:
        rc = command()
    except KeyboardInterrupt as e:  # raised outside the command's own handling of it
        default_signals()
        name = getattr(e, "signame", None) or "SIGINT"
        print(f"fastgrpo: {interrupted_line(name, getattr(e, 'where', None))}", file=sys.stderr)
        return 128 + int(getattr(signal, name, signal.SIGINT))
    finally:
        default_signals()
    return rc


def _run(args, cfg, source: str, unused: List[str], log, main_rank: bool, existed: bool) -> int:
    """The command's library function, its failures turned into one line and an exit code."""
    from fastgrpo.logs.console import quiet_console
    from fastgrpo.runs.folder import discard_unused

    out = cfg.logging.out_dir
    # every command may start an engine: the libraries' logs go to the run folder
    from fastgrpo.trainer.backend import launcher_env

    logfile = quiet_console(cfg.logging.out_dir, verbose=args.verbose, rank=launcher_env().rank)  # rank N: log-rankN.txt
    log(f"[fastgrpo] {args.command}: settings: {source}; run folder {cfg.logging.out_dir}"
        + ("" if args.verbose else f" (library logs: {logfile})"))
    for line in unused:  # an explicit --set is never dropped without a word
        log(f"[fastgrpo] {line}")
    from fastgrpo import pipeline
    from fastgrpo.trainer.grpo import TrainingStopped
    from fastgrpo.runs.folder import TrainingInterrupted

    run = {"train": pipeline.run_train, "sft": pipeline.run_sft_only,
           "eval": functools.partial(pipeline.run_eval, allow_untrained=getattr(args, "untrained", False)),
           "bench": pipeline.run_bench, "fuse": _fuse}[args.command]
    try:
        run(cfg, log=log)
    except TrainingStopped as e:
        log(f"fastgrpo: {e}", file=sys.stderr)
        return 3
    except TrainingInterrupted as e:  # SIGINT / SIGTERM during GRPO: checkpoint written
        log(f"fastgrpo: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM outside GRPO's steps (or a second one): stops at once
        from fastgrpo.runs.folder import interrupted_line

        name = getattr(e, "signame", None) or str(e) or "SIGINT"
        log(f"fastgrpo: {interrupted_line(name, getattr(e, 'where', None))}", file=sys.stderr)
        return 143 if name == "SIGTERM" else 130
    except Exception as e:  # noqa: BLE001 — expected input errors are one line (exit 2); others re-raise
        if not _expected(e, out):
            raise
        if not existed:  # refused before the run began: leave no run folder behind
            discard_unused(out)
        return _fail(e, args, log, out)
    return 0


def _info(argv: List[str]) -> int:
    """`fastgrpo env` (the bug-report block of fastgrpo.native.envinfo) and `fastgrpo --version`."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --version prints and exits 0; a bad option prints its usage, exits 2
        return int(e.code or 0)
    from fastgrpo.native.envinfo import report

    print(report(quick=args.quick))
    return 0


def _export(argv: List[str], log) -> int:
    """`fastgrpo export --merge <run> <folder>` (fastgrpo.trainer.lora_run.export_merged)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # a bad option prints its usage
        return int(e.code or 0)
    from fastgrpo.trainer.lora_run import export_merged

    try:
        out = export_merged(args.run, args.folder, overwrite=args.overwrite)
    except Exception as e:  # noqa: BLE001 — expected input errors are one line (exit 2); others re-raise
        return _fail(e, args, log)
    log(f"[fastgrpo] export: {args.run} merged into its base → {out}")
    return 0


def _fuse(cfg, log):
    from fastgrpo.recipes.fusion import run_fuse

    return run_fuse(cfg, log=log)


def _expected(e: BaseException, out_dir: Optional[str] = None) -> bool:
    """A failure of the user's input (config, files, data) or of the machine the user can fix (a
    full disk, a read-only file system, permissions: fastgrpo.runs.folder.describe_os_error)
    rather than a bug of fastgrpo."""
    import yaml

    from fastgrpo.runs.folder import describe_os_error

    return isinstance(e, (ValueError, FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError,
                          yaml.YAMLError)) or describe_os_error(e, out_dir) is not None


def _fail(e: BaseException, args, log, out_dir: Optional[str] = None) -> int:
    """One line naming the problem (file, line, field), exit code 2; `--debug` adds the traceback."""
    if not _expected(e, out_dir):
        raise e
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(e)
    log(f"fastgrpo: {_one_line(e, out_dir)}", file=sys.stderr)
    return 2


def _one_line(e: BaseException, out_dir: Optional[str] = None) -> str:
    import yaml

    from fastgrpo.runs.folder import describe_os_error

    line = describe_os_error(e, out_dir) if not isinstance(e, ValueError) else None
    if line is not None:
        return line

    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        m = e.problem_mark
        return f"{m.name}:{m.line + 1}:{m.column + 1}: invalid YAML ({e.problem})"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text ({e.reason} at byte {e.start})"
    if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)) and e.filename:
        return f"{e.filename}: {e.strerror}"
    text = str(e).strip() or type(e).__name__
    return " ".join(text.split("\n")[0].split()) if "\n" in text else text


if __name__ == "__main__":
    sys.exit(main())
