"""GPU kernels of torch.profiler Chrome traces (the demo's `--profile --trace` files), per step,
side by side, and for kernels matching --who the host ops that launched them.

    python benchmarks/trace_kernels.py TRACE.json.gz [TRACE2.json.gz ...] --steps 5 \
        [--top 40] [--who copy elementwise]

The first table: each kernel name's GPU time (ms a step) in each trace, sorted by the largest
difference between the first trace and the others. The second: for kernels whose name holds
a --who word, the chain of host ops (innermost last, with the innermost op's input shapes) that
launched them, ms a step, per trace.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def summarize(path: str, who: list[str]) -> tuple[dict[str, float], dict[tuple, float]]:
    """(GPU us by kernel name, GPU us by (kernel, launching op chain)) of one trace."""
    events = _load(path)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy") and e.get("ph") == "X"]
    by_name: dict[str, float] = collections.Counter()
    for k in kernels:
        by_name[k["name"]] += k.get("dur", 0.0)
    wanted = [k for k in kernels if any(w in k["name"] for w in who)]
    if not wanted:
        return by_name, {}
    launches = {e["args"].get("correlation"): e for e in events
                if e.get("cat") == "cuda_runtime" and e.get("ph") == "X" and "args" in e}
    ops_by_tid: dict = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("ph") == "X":
            ops_by_tid[(e.get("pid"), e.get("tid"))].append(e)
    for ops in ops_by_tid.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_tid.items()}
    by_chain: dict[tuple, float] = collections.Counter()
    for k in wanted:
        launch = launches.get(k.get("args", {}).get("correlation"))
        chain: tuple = ("?",)
        if launch is not None:
            tid = (launch.get("pid"), launch.get("tid"))
            ops, st = ops_by_tid.get(tid, []), starts.get(tid, [])
            t = launch["ts"]
            i = bisect.bisect_right(st, t)
            enclosing = [e for e in ops[max(0, i - 400) : i] if e["ts"] + e.get("dur", 0) >= t]
            names = [e["name"] for e in enclosing if not e["name"].startswith("ProfilerStep")]
            inner = enclosing[-1] if enclosing else None
            shapes = inner.get("args", {}).get("Input Dims") if inner else None
            chain = (*[_short(n, 50) for n in names[-4:]], str(shapes)[:80])
        by_chain[(_short(k["name"], 60), chain)] += k.get("dur", 0.0)
    return by_name, by_chain


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--steps", type=int, default=5, help="profiled steps in each trace")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--who", nargs="*", default=["copy", "elementwise", "Memcpy", "cat"])
    args = p.parse_args()
    names = [os.path.basename(t).removeprefix("trace_").removesuffix("_rank0.json.gz") for t in args.traces]
    sums = [summarize(t, args.who) for t in args.traces]
    ms = lambda us: us / args.steps / 1000.0  # noqa: E731
    all_names = set().union(*(s[0] for s in sums))
    rows = sorted(all_names, key=lambda n: -max(abs(ms(s[0].get(n, 0)) - ms(sums[0][0].get(n, 0))) for s in sums)
                  - 1e-6 * ms(sums[0][0].get(n, 0)))
    print("ms a step: " + " | ".join(names))
    print("total: " + " | ".join(f"{ms(sum(s[0].values())):.2f}" for s in sums))
    for n in rows[: args.top]:
        print(" | ".join(f"{ms(s[0].get(n, 0)):8.3f}" for s in sums), " ", _short(n, 110))
    for name, (_, chains) in zip(names, sums):
        print(f"\n== launchers in {name} (ms a step, kernel, host op chain innermost last, its input dims)")
        for (kern, chain), us in sorted(chains.items(), key=lambda kv: -kv[1])[:25]:
            print(f"{ms(us):7.3f}  {kern}  <-  {' > '.join(chain)}")


if __name__ == "__main__":
    main()
