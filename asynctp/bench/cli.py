"""`asynctp bench`: its options, and the run they describe."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from asynctp.bench.cases import CASES
from asynctp.bench.measure import DTYPES, BenchConfig
from asynctp.bench.shapes import SHAPE_SETS, expand_sets

__all__ = ["add_arguments", "run", "config_from_args", "command_of"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `asynctp bench` options (asynctp.cli calls this for the subcommand's parser)."""
    parser.add_argument("--op", default="all", choices=[*CASES, "all"],
                        help="which op to time (all: every op this installation has)")
    parser.add_argument("--shapes", default=None, choices=[*SHAPE_SETS, "all"],
                        help="shape set (all: seed, llama8b, llama70b, small); default seed, tiny without GPUs")
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--iters", type=int, default=50, help="timed calls per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls before them")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks to spawn (default: one per local GPU, 2 CPU ranks without GPUs)")
    parser.add_argument("--out", default="benchmarks/results",
                        help="directory for <op>_<hardware>_<date>.json/.md/.png and README.md ('' for none)")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graphed variants")
    parser.add_argument("--tune", action="store_true",
                        help="record the fastest eager strategy per shape in asynctp's tuning cache (the two "
                             "fastest, where within 5%%, timed head to head), then time auto")
    parser.add_argument("--hardware", default=None, help="results file tag (default e.g. 2xH200)")
    parser.add_argument("--verbose", "-v", action="store_true", help="name every step before it runs (stderr)")
    parser.add_argument("--contention", action="store_true",
                        help="instead of the op table: how much NCCL's and asynctp's all-gather slow a matmul "
                        "running beside them (CUDA only)")
    parser.add_argument("--contention-size", type=int, default=8192, help="--contention: the matmul's M = N = K")
    parser.add_argument("--contention-mb", type=int, default=256, help="--contention: MB gathered per rank")
    parser.add_argument("--checks", action="store_true",
                        help="instead of the op table: host time per call of the call checks, on and off")
    parser.add_argument("--readme", action="store_true", help="measure nothing: rewrite the .md/.png of every JSON file in --out, and its README.md")


def _has_gpus() -> bool:
    """CUDA GPUs here: then ranks are GPUs and the default shape set is seed, else tiny."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def command_of(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, options spelled out."""
    parts = ["asynctp", "bench", "--op", args.op, "--shapes", args.shapes or ("seed" if _has_gpus() else "tiny"),
             "--dtype", args.dtype, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    if args.nproc is not None:
        parts += ["--nproc", str(args.nproc)]
    parts += [flag for flag, on in (("--no-graph", args.no_graph), ("--tune", args.tune)) if on]
    if args.hardware:
        parts += ["--hardware", args.hardware]
    if args.contention:
        parts = ["asynctp", "bench", "--contention", "--contention-size", str(args.contention_size),
                 "--contention-mb", str(args.contention_mb)] + (["--nproc", str(args.nproc)] if args.nproc else [])
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        parts = ["torchrun", f"--nproc-per-node={os.environ['WORLD_SIZE']}", "-m", "asynctp.cli", *parts[1:]]
    return shlex.join(parts)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The run's BenchConfig (ValueError for inconsistent options)."""
    shapes = args.shapes or ("seed" if _has_gpus() else "tiny")
    if args.iters < 1:
        raise ValueError(f"--iters requires a positive count, got {args.iters}")
    if args.warmup < 0:
        raise ValueError(f"--warmup requires a non-negative count, got {args.warmup}")
    ops = tuple(CASES) if args.op == "all" else (args.op,)
    return BenchConfig(
        ops=ops, shape_sets=expand_sets(shapes), dtype=args.dtype, iters=args.iters, warmup=args.warmup,
        graph=not args.no_graph, tune=args.tune, hardware=args.hardware, command=command_of(args),
        verbose=args.verbose,
        contention=(args.contention_size, args.contention_mb) if args.contention else None,
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark the options describe (or only rewrite the reports); the exit code."""
    if args.readme:
        from asynctp.bench.index import regenerate

        if not args.out:
            print("asynctp bench --readme requires --out DIR, got ''", file=sys.stderr)
            return 2
        for path in regenerate(args.out):
            print(f"wrote {path}")
        return 0
    if args.checks:
        from asynctp.bench.checks import main

        return main(args.nproc, args.iters * 20, args.warmup * 10)
    from asynctp.bench.launch import launch, plan

    if args.contention and not _has_gpus():
        print("asynctp bench --contention requires CUDA GPUs, got none", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)
        how = plan(args.nproc)
    except ValueError as exc:
        print(f"asynctp bench: {exc}", file=sys.stderr)
        return 2
    return launch(cfg, how, args.out or None)
