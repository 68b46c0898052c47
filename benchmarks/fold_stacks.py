"""Summarize py-spy's folded stacks (benchmarks/native_profile.sh windows): samples per thread kind,
the innermost Python frames of each, and what runs below a frame that matches --below.

    python benchmarks/fold_stacks.py OUTDIR/window_24.txt OUTDIR/window_25.txt --below backend_impl

Threads: "main" (the rank's own thread: forward, optimizer, waits), "autograd" (torch's device
thread, where the backward's host work runs), "other" (compile workers, watchdogs). A sample with
no Python frame below the thread's entry is the thread waiting (py-spy --idle keeps those).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def _kind(stack: str) -> str:
    if "thread_main" in stack and "spawn_main" not in stack:
        return "autograd"
    return "main" if "spawn_main" in stack else "other"


def summarize(paths: list[Path], below: str | None, top: int) -> str:
    totals: collections.Counter = collections.Counter()
    inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    under: collections.Counter = collections.Counter()
    hits = 0
    for path in paths:
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            n, frames = int(count), stack.split(";")
            kind = _kind(stack)
            totals[kind] += n
            python = [f for f in frames if ".py:" in f]
            inner[kind][python[-1] if python else "(waiting: no Python frame)"] += n
            at = [i for i, f in enumerate(frames) if below and below in f]
            if kind != "other" and at:
                hits += n
                under[" ; ".join(frames[at[-1] + 1: at[-1] + 4]) or "(itself)"] += n
    lines = [f"samples: {dict(totals)}"]
    for kind in ("main", "autograd"):
        lines.append(f"-- {kind}: innermost Python frames")
        lines += [f"{n:>7}  {frame[:160]}" for frame, n in inner[kind].most_common(top)]
    if below:
        lines.append(f"-- below the last frame matching {below!r} ({hits} samples, main and autograd threads)")
        lines += [f"{n:>7}  {frames[:240]}" for frames, n in under.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("windows", type=Path, nargs="+", help="py-spy --format raw files")
    parser.add_argument("--below", default=None, help="a frame name: what its callees are")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    print(summarize(args.windows, args.below, args.top))


if __name__ == "__main__":
    main()
