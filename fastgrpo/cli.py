"""`fastgrpo` command line: train | sft | eval | bench | fuse.

Each subcommand builds a `TrainConfig` (the embedded demo config when no --config is given,
then --set overrides) and calls one library function of fastgrpo.pipeline; nothing else
happens here (house style rule 5).

    fastgrpo train                                  # the embedded demo, end to end
    fastgrpo train --config run.yaml --set optimizer.lr=1e-4 --out runs/a
    fastgrpo sft --set sft.steps=500
    fastgrpo eval --set model.path=runs/a           # held-out accuracy, pass@k (eval.num_samples)
    fastgrpo bench --set steps=10                   # median seconds per phase, tokens/s
    fastgrpo fuse --set model.path=runs/a           # thinking-mode fusion of a trained run + budget sweep
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
import sys
import time
from typing import List, Optional

COMMANDS = ("train", "sft", "eval", "bench", "fuse")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastgrpo", description="GRPO / RLVR training with fused kernels")
    sub = p.add_subparsers(dest="command")
    for name, help_ in (("train", "SFT cold start + GRPO (+ held-out eval before and after)"),
                        ("sft", "the SFT cold start only"), ("eval", "held-out accuracy / pass@k of model.path"),
                        ("bench", "seconds per phase and tokens/s of a few GRPO steps"),
                        ("fuse", "thinking-mode fusion (Qwen3) of model.path + the thinking-budget sweep")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", help="YAML file of config sections (default: the embedded demo)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                       help="override one field, e.g. --set optimizer.lr=1e-4 (repeatable)")
        s.add_argument("--out", help="run folder (logging.out_dir); an existing one resumes")
        s.add_argument("--nvtx", action="store_true", help="emit an NVTX range per phase (Nsight Systems)")
        s.add_argument("--verbose", action="store_true",
                       help="show the libraries' logs (vLLM, transformers, …) instead of writing them to <run>/log.txt")
        s.add_argument("--debug", action="store_true", help="print the traceback of an error, not only its one-line message")
    return p


def uses_demo(args) -> bool:
    """The embedded demo's settings apply when there is no --config and model.path is not set
    to anything but the demo's tiny model; a user's checkpoint starts from the library defaults
    (fastgrpo/config/schema.py: settings for a pretrained model)."""
    from fastgrpo.config import parse_override

    if args.config:
        return False
    path = "tiny"
    for item in args.overrides:
        keys, value = parse_override(item)
        if keys == ["model", "path"] or (keys == ["model"] and isinstance(value, dict) and "path" in value):
            path = value if keys == ["model", "path"] else value["path"]
    return path == "tiny"


def config_from_args(args):
    """TrainConfig of parsed args: the embedded demo (or --config, or the library defaults for a
    model.path of the user's), --set, --out, --nvtx; and which of the three it started from."""
    from fastgrpo.config import load_config
    from fastgrpo.demo.default import default_config

    overrides = list(args.overrides)
    if args.nvtx:
        overrides.append("logging.nvtx=true")
    out = args.out or f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.config:
        return load_config(args.config, overrides + [f"logging.out_dir={out}"]), f"config file {args.config}"
    if args.command == "fuse":  # a run folder's own settings (task, rollout, rewards) carry over to its fusion
        from fastgrpo.trainer.fusion import run_config_path

        found = run_config_path(args.overrides)
        if found:
            return load_config(found, overrides + [f"logging.out_dir={out}"]), f"the RL run's config {found}"
    if uses_demo(args):
        return default_config(overrides, out_dir=out), "the embedded demo (fastgrpo/demo/default.py)"
    return load_config(None, overrides + [f"logging.out_dir={out}"]), "the library defaults for a pretrained model"


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
    from fastgrpo.trainer.backend import launcher_env

    argv = strip_local_rank(list(sys.argv[1:] if argv is None else argv))
    try:
        rank = launcher_env().rank
    except ValueError as e:
        print(f"fastgrpo: {e}", file=sys.stderr)
        return 2
    main_rank = rank == 0

    def log(*a, **k):  # every rank computes the same thing: one copy of the output is enough
        if main_rank:
            print(*a, **k)

    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["train"] + argv  # `fastgrpo` alone (or with options only) runs the demo
    args = build_parser().parse_args(argv)
    try:
        cfg, source = config_from_args(args)
    except Exception as e:  # noqa: BLE001 — every expected failure of the config is one line
        return _fail(e, args, log)
    from fastgrpo.trainer.console import quiet_console

    # every command may start an engine: the libraries' logs go to the run folder
    logfile = quiet_console(cfg.logging.out_dir, verbose=args.verbose or not main_rank)
    log(f"[fastgrpo] {args.command}: settings from {source}; run folder {cfg.logging.out_dir}"
        + ("" if args.verbose else f" (library logs: {logfile})"))
    from fastgrpo import pipeline
    from fastgrpo.trainer.grpo import TrainingStopped
    from fastgrpo.trainer.runfolder import TrainingInterrupted

    run = {"train": pipeline.run_train, "sft": pipeline.run_sft_only, "eval": pipeline.run_eval,
           "bench": pipeline.run_bench, "fuse": _fuse}[args.command]
    try:
        run(cfg, log=log)
    except TrainingStopped as e:
        log(f"fastgrpo: {e}", file=sys.stderr)
        return 3
    except TrainingInterrupted as e:  # SIGINT / SIGTERM during GRPO: checkpoint written
        log(f"fastgrpo: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # SIGINT / SIGTERM before GRPO (or a second one): nothing to save
        name = str(e) or "SIGINT"
        log(f"fastgrpo: interrupted by {name} before any GRPO step finished; run the same command to resume",
            file=sys.stderr)
        return 143 if name == "SIGTERM" else 130
    except Exception as e:  # noqa: BLE001 — expected input errors are one line (exit 2); others re-raise
        if not _expected(e):
            raise
        return _fail(e, args, log)
    return 0


def _fuse(cfg, log):
    from fastgrpo.trainer.fusion import run_fuse

    return run_fuse(cfg, log=log)


def _expected(e: BaseException) -> bool:
    """A failure of the user's input (config, files, data) rather than a bug of fastgrpo."""
    import yaml

    return isinstance(e, (ValueError, FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError,
                          yaml.YAMLError))


def _fail(e: BaseException, args, log) -> int:
    """One line naming the problem (file, line, field), exit code 2; `--debug` adds the traceback."""
    if not _expected(e):
        raise e
    if getattr(args, "debug", False):
        import traceback

        traceback.print_exception(e)
    log(f"fastgrpo: {_one_line(e)}", file=sys.stderr)
    return 2


def _one_line(e: BaseException) -> str:
    import yaml

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
