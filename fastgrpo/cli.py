"""`fastgrpo` command line: train | sft | eval | bench.

Each subcommand builds a `TrainConfig` (the embedded demo config when no --config is given,
then --set overrides) and calls one library function of fastgrpo.pipeline; nothing else
happens here (house style rule 5).

    fastgrpo train                                  # the embedded demo, end to end
    fastgrpo train --config run.yaml --set optimizer.lr=1e-4 --out runs/a
    fastgrpo sft --set sft.steps=500
    fastgrpo eval --set model.path=runs/a           # held-out accuracy, pass@k (eval.num_samples)
    fastgrpo bench --set steps=10                   # median seconds per phase, tokens/s
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

COMMANDS = ("train", "sft", "eval", "bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastgrpo", description="GRPO / RLVR training with fused kernels")
    sub = p.add_subparsers(dest="command")
    for name, help_ in (("train", "SFT cold start + GRPO (+ held-out eval before and after)"),
                        ("sft", "the SFT cold start only"), ("eval", "held-out accuracy / pass@k of model.path"),
                        ("bench", "seconds per phase and tokens/s of a few GRPO steps")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--config", help="YAML file of config sections (default: the embedded demo)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                       help="override one field, e.g. --set optimizer.lr=1e-4 (repeatable)")
        s.add_argument("--out", help="run folder (logging.out_dir); an existing one resumes")
        s.add_argument("--nvtx", action="store_true", help="emit an NVTX range per phase (Nsight Systems)")
    return p


def config_from_args(args):
    """TrainConfig of parsed args: the embedded demo (or --config), --set, --out, --nvtx."""
    from fastgrpo.config import load_config
    from fastgrpo.demo.default import default_config

    overrides = list(args.overrides)
    if args.nvtx:
        overrides.append("logging.nvtx=true")
    out = args.out or f"runs/{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.config:
        return load_config(args.config, overrides + [f"logging.out_dir={out}"])
    return default_config(overrides, out_dir=out)


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
        cfg = config_from_args(args)
    except ValueError as e:
        log(f"fastgrpo: {e}", file=sys.stderr)
        return 2
    from fastgrpo import pipeline
    from fastgrpo.trainer.grpo import TrainingStopped

    run = {"train": pipeline.run_train, "sft": pipeline.run_sft_only, "eval": pipeline.run_eval,
           "bench": pipeline.run_bench}[args.command]
    try:
        run(cfg, log=log)
    except TrainingStopped as e:
        log(f"fastgrpo: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
