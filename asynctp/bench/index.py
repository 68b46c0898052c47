"""The results directory's index: its README (the newest table per op and hardware, checked
against the targets, and the other records), regenerated from the JSON files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from asynctp.bench.report import (
    AUTO, AUTO_GRAPH, AUTO_PAIRED, MM_PAIRED, TORCH, TORCH_GRAPH, _README_COMMAND, _label, markdown,
)

__all__ = ["EFFICIENCY_TARGET", "target_efficiency", "target_notes", "write_readme", "regenerate"]


def regenerate(out_dir: str | Path) -> list[Path]:
    """Rewrite every results file's .md (and .png, with matplotlib) from its .json, then
    README.md: for results copied from another machine, or after a change to the format."""
    from asynctp.bench.plot import plot_efficiency

    out = Path(out_dir)
    written = []
    for path, rows in _results_files(out):
        path.with_suffix(".md").write_text(markdown(rows, title=True))
        written.append(path.with_suffix(".md"))
        png = plot_efficiency(rows, path.with_suffix(".png"))
        if png is not None:
            written.append(png)
    written.append(write_readme(out))
    return written


EFFICIENCY_TARGET = 0.92  # max(mm, comm) / auto at seed M 4096 and 8192, every op


def target_efficiency(op: str) -> float:
    """The efficiency an op's seed rows are checked against."""
    return EFFICIENCY_TARGET


def target_notes(rows: list[dict[str, Any]]) -> list[str]:
    """The op's targets, checked against its rows (a line each, met or not)."""
    ok = [r for r in rows if not r.get("error") and r["times_us"].get(AUTO)]
    failed = [f"{r['shape_set']} {_label(r)}" for r in rows if r.get("error")]
    notes = [f"NOT met: {len(failed)} row(s) failed their check or did not run: {', '.join(failed)}"] if failed else []
    big = [r for r in ok if r["shape_set"] == "seed" and r["m"] in (4096, 8192)]
    if big:
        eff_target = target_efficiency(big[0]["op"])
        # auto's efficiency from rounds with the local matmul where the row has it (no drift between them)
        both = all(r["times_us"].get(MM_PAIRED) for r in big)
        eff = {r["m"]: r["efficiency"].get(AUTO_PAIRED if both else AUTO, 0) for r in big}
        effs = ", ".join(f"{m}: {e:.2f}" for m, e in eff.items())
        met = all(e >= eff_target for e in eff.values())
        paired = " (paired with mm only)" if both else ""
        notes.append(f"{'met' if met else 'NOT met'}: eager auto efficiency{paired} >= {eff_target} "
                     f"at seed M 4096/8192 ({effs})")
    seed = [r for r in ok if r["shape_set"] == "seed"]
    torch_best = [(r, min(v for k, v in r["times_us"].items() if k in (TORCH, TORCH_GRAPH) and v))
                  for r in seed if r["times_us"].get(TORCH)]
    if torch_best:
        slower = [f"{r['m']}: {r['times_us'][AUTO]:.0f} vs {t:.0f} us" for r, t in torch_best if r["times_us"][AUTO] > t]
        notes.append("met: eager auto faster than torch's fused op (best of eager, graph) at every seed shape"
                     if not slower else f"NOT met: eager auto slower than torch's best at seed M {'; '.join(slower)}")
    ratios = [(r, r["auto_vs_serial"]) for r in ok if r.get("auto_vs_serial") is not None]
    if ratios:
        worst_row, worst = min(ratios, key=lambda x: x[1])
        notes.append(f"{'met' if worst >= 0.98 else 'NOT met'}: serial / auto >= 0.98 at every shape "
                     f"(lowest {worst:.2f}, {worst_row['shape_set']} {_label(worst_row)})")
    graphed = [r for r in ok if r["times_us"].get(AUTO_GRAPH)]
    if graphed:
        slower_g = [f"{r['shape_set']} {_label(r)}" for r in graphed if r["times_us"][AUTO_GRAPH] > r["times_us"][AUTO]]
        notes.append("met: graphed auto at least as fast as eager at every shape" if not slower_g
                     else f"NOT met: graphed auto slower than eager at {', '.join(slower_g)}")
    return notes


def _results_files(out: Path) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    """(path, rows) of every benchmark results JSON in `out` (demo and contention records, which
    have no "rows", are skipped)."""
    for path in sorted(out.glob("*.json")):
        try:
            rows = json.loads(path.read_text())["rows"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if rows:
            yield path, rows


def _latest_runs(out: Path) -> dict[tuple[str, str], tuple[Path, list[dict[str, Any]]]]:
    """(op, hardware) -> the newest results file and its rows."""
    latest: dict[tuple[str, str], tuple[Path, list[dict[str, Any]]]] = {}
    for path, rows in _results_files(out):
        key = (rows[0]["op"], rows[0]["hardware"])
        if key not in latest or rows[0]["date"] >= latest[key][1][0]["date"]:
            latest[key] = (path, rows)
    return latest


# the records without op rows, by file name prefix: what made them
_OTHER_RECORDS = {
    "demo": "training steps of the demo's model (`asynctp demo`)",
    "train_bench": "the training benchmark (`benchmarks/train_bench.py`)",
    "torchtitan": "torchtitan 0.3's trainer: default TP, dist_gemm, dist_gemm on asynctp (`benchmarks/torchtitan_bench.sh`)",
    "contention": "a matmul beside NCCL's and asynctp's all-gather (`asynctp bench --contention`)",
    "kernels": "the single-launch GEMMs against cuBLAS on one GPU (`benchmarks/kernels.py`)",
    "soak": "random calls with injected faults on CPU ranks (`benchmarks/soak.py`)",
}


def _other_records(out: Path, tables: set[Path]) -> list[str]:
    """An index of the JSON records that are not op tables, grouped by what made them."""
    lines = []
    for prefix, what in _OTHER_RECORDS.items():
        files = [p for p in sorted(out.glob(f"{prefix}*.json")) if p not in tables]
        if files:
            lines.append(f"- {what[0].upper() + what[1:]}: " + ", ".join(f"[{p.name}]({p.name})" for p in files))
    if not lines:
        return []
    return ["## Other records", "", *lines,
            "", "What was measured and decided: [docs/performance.md](../../docs/performance.md).", ""]


def write_readme(out_dir: str | Path) -> Path:
    """Regenerate <out_dir>/README.md: the newest table per op and hardware (GPUs before CPU)."""
    out = Path(out_dir)
    latest = _latest_runs(out)
    lines = [
        "# Benchmark results",
        "",
        "Generated by `asynctp bench` from the JSON files in this directory; regenerate with",
        f"`{_README_COMMAND}`. Per op, the newest run on each hardware.",
        "",
        "Rows \"M x N x K\" are per rank (R ranks): all-gather rows gather an [M/R, K] shard on dim 0",
        "and multiply by b [K, N] (w13: two b of N/2 columns); reduce-scatter rows multiply a [M, N]",
        "by b [N, K] and reduce-scatter the [M, K] product on dim 0. Times are the slowest rank's",
        "median in microseconds; \"mm only\" is the full local matmul, \"comm only\" the NCCL",
        "collective alone, \"serial\" the collective then the matmul. Efficiency = max(mm only, comm",
        "only) / time; serial / auto > 1 means auto is faster; \"(tuned)\": auto ran after `--tune`",
        "recorded the fastest eager strategy for the shape. Every variant was checked against serial",
        "before it was timed.",
        "",
    ]
    if not latest:
        lines += ["No results yet. On a machine with GPUs, from the repository root, run:", "",
                  "    python -m asynctp.cli bench --op all --shapes all --tune --out benchmarks/results", ""]
    ordered = sorted(latest, key=lambda k: (k[1].endswith("xcpu"), k[0], k[1]))
    for op, hardware in ordered:
        path, rows = latest[(op, hardware)]
        lines += [f"## {op} on {hardware}", "", markdown(rows).rstrip(), ""]
        notes = target_notes(rows)
        if notes:
            lines += ["Targets:", "", *[f"- {n}" for n in notes], ""]
        png = path.with_suffix(".png")
        if png.exists():
            lines += [f"![efficiency per shape]({png.name})", ""]
        lines += [f"Data: [{path.name}]({path.name})", ""]
    lines += _other_records(out, {p for p, _ in _results_files(out)})
    readme = out / "README.md"
    readme.write_text("\n".join(lines))
    return readme
