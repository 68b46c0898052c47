"""Training step time of TP variants in one run: eager and compiled vanilla TP, torch's async TP,
asynctp's pass and styles, a no-communication baseline, fp8 rowwise; per batch size.

    python benchmarks/train_bench.py                          # >= 2 GPUs: the Llama-3-8B-shaped 4-layer
                                                              # stack (seq 8192), batch 1 and 2, TP = GPUs
    python benchmarks/train_bench.py --cpu --steps 3 --batch-sizes 2   # CPU (gloo): the tiny model

Each configuration is one `asynctp demo` launch (fwd + bwd + AdamW, the host waiting every
--sync-every steps); the launches' runs are merged into one table. "hidden" is the share of the
communication cost vanilla TP pays (its step time minus the no-communication run's, same
configuration) that a variant removes; peak memory is torch.cuda's (empty on CPU).
torchtitan's dist_gemm is not timed here: run examples/torchtitan/train.py with and without
--asynctp.off.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from asynctp.demo import cli as demo

# (label, demo flags): the no-communication baseline runs in every configuration, so each
# variant's hidden share is against its own kind of step (eager or compiled)
CONFIGS = {
    "eager": ("eager", ["--no-comm-baseline"]),
    "compiled": ("compiled", ["--compile", "--no-comm-baseline", "--asynctp-pass", "--torch-async-tp"]),
    "fp8": ("fp8 rowwise, compiled", ["--compile", "--float8", "rowwise"]),
}


def _demo_args(flags: list[str], args: argparse.Namespace, batch: int, out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = [*flags, "--batch-size", str(batch), "--sync-every", str(args.sync_every), "--out", str(out)]
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.model is not None:
        argv += ["--model", args.model]
    if args.cpu:
        argv.append("--cpu")
    if args.profile:
        argv.append("--profile")
    if args.profile_gpu:
        argv.append("--profile-gpu")
    if args.interleave:
        argv.append("--interleave")
    if args.cpu or torch.cuda.device_count() < 2:  # torch's async TP needs GPUs
        argv = [a for a in argv if a != "--torch-async-tp"]
    return parser.parse_args(argv)


def rows(label: str, batch: int, runs: list[dict[str, Any]], compiled_vanilla: float | None) -> list[list[str]]:
    vanilla = runs[0]["step_time_s"]
    no_comm = next((r["step_time_s"] for r in runs if r.get("no_comm")), None)
    out = []
    for r in runs:
        t = r["step_time_s"]
        hidden = "" if no_comm is None or r.get("no_comm") or vanilla <= no_comm else f"{100 * (vanilla - t) / (vanilla - no_comm):.0f}%"
        peak = r.get("peak_memory_bytes")
        out.append([label, str(batch), r["name"], f"{1e3 * t:.1f}",
                    f"{compiled_vanilla / t:.2f}x" if compiled_vanilla else "", hidden,
                    f"{peak / 2**30:.2f}" if peak else "-"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="demo model size (default: 8b-block on GPUs, tiny on CPU)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the demo's)")
    parser.add_argument("--sync-every", type=int, default=10)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--profile", action="store_true",
                        help="profile 5 extra steps per run (GPU): exposed communication, top kernels, collectives")
    parser.add_argument("--profile-gpu", action="store_true",
                        help="profile 10 extra steps per run, the GPU's activity only (demo --profile-gpu): the GPU's "
                             "busy time against the wall in a step that stays GPU-bound")
    parser.add_argument("--interleave", action="store_true",
                        help="each configuration's variants step by step in turn (demo --interleave): drift over a "
                             "run touches them alike; no per-variant peak memory")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/train_bench"))
    args = parser.parse_args(argv)
    table = [["config", "batch", "variant", "ms/step", "vs compiled vanilla", "hidden", "peak GiB"]]
    for batch in args.batch_sizes:
        collected: list[tuple[str, list[dict[str, Any]]]] = []
        for label, flags in (CONFIGS[c] for c in args.configs):
            got: list = []
            out = args.out / f"{label.replace(', ', '-').replace(' ', '-')}-b{batch}"
            if demo.run(_demo_args(flags, args, batch, out), collect=got) != 0:
                return 1
            collected.append((label, got[0][0]))
        compiled_vanilla = next((runs[0]["step_time_s"] for label, runs in collected if label == "compiled"), None)
        for label, runs in collected:
            table += rows(label, batch, runs, compiled_vanilla)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print()
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
