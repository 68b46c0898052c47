"""The results record: row fields derived from the times, tables (stdout, markdown), result files,
and benchmarks/results/README.md regenerated from the JSON files.

A row (one op, shape set, shape and dtype) is a JSON object; its "times_us" maps variant ->
the slowest rank's median time in microseconds:

    compute_bound       the full local matmul alone      comm_bound   the collective alone
    serial              asynctp strategy="serial" (NCCL/gloo collective, then cuBLAS/CPU matmul)
    torch_fused(_graph) torch.ops.symm_mem's fused op, eager (and CUDA-graphed)
    asynctp_<strategy>  each pipelined strategy, eager
    asynctp_auto(_graph) strategy="auto", eager (and CUDA-graphed)
    serial_paired, asynctp_auto_paired   serial and auto again, timed in alternating rounds

A variant that could not run has time None and its reason under "skipped". Efficiency of a variant is
max(compute_bound, comm_bound) / its time; auto_vs_serial is serial's time / auto's time, both
from the same alternating rounds (serial_paired, asynctp_auto_paired) where the row has them.
Every other column is timed alone, back to back, as torch's are: a block of a paired round
timed the same replayed code 1-6% slower than the standalone column (2xH200, fp8 all-gather),
so older rows whose asynctp_auto was the paired time understate auto against torch by that
much. "graph_calls" maps each
asynctp variant to its calls' counts in asynctp's CUDA-graph cache during its timing (eager /
captured / replayed and why eager, non-zero ones only: asynctp/runtime/graphs.py), i.e. whether its
eager time measured replays or launches.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "COMPUTE", "COMM", "SERIAL", "TORCH", "TORCH_GRAPH", "AUTO", "AUTO_GRAPH", "SERIAL_PAIRED", "AUTO_PAIRED",
    "MM_PAIRED",
    "today", "default_hardware", "derive", "columns", "format_table", "progress_line",
    "results_stem", "merge_rows", "write_results", "markdown",
]

COMPUTE, COMM, SERIAL = "compute_bound", "comm_bound", "serial"
TORCH, TORCH_GRAPH = "torch_fused", "torch_fused_graph"
AUTO, AUTO_GRAPH = "asynctp_auto", "asynctp_auto_graph"
SERIAL_PAIRED = "serial_paired"  # serial, timed in alternating rounds with auto
AUTO_PAIRED = "asynctp_auto_paired"  # auto, timed in those rounds (older rows: in AUTO)
MM_PAIRED = "compute_paired"  # the local matmul (mm only), timed in those rounds: auto's paired efficiency

_HEADINGS = {
    COMPUTE: "mm only", COMM: "comm only", MM_PAIRED: "mm only paired", SERIAL: "serial", TORCH: "torch fused",
    TORCH_GRAPH: "torch fused graph", AUTO: "asynctp auto", AUTO_GRAPH: "asynctp auto graph",
}
_README_COMMAND = "python -m asynctp.cli bench --readme --out benchmarks/results"


def today() -> str:
    """The UTC date, yyyy-mm-dd (results files are named by it)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def default_hardware(device_name: str, world_size: int) -> str:
    """"2xH200" for two "NVIDIA H200"; "2xcpu" for CPU ranks. Safe in a file name."""
    name = device_name.removeprefix("NVIDIA").strip()
    token = re.split(r"[\s_-]+", name)[0] if name else "cpu"
    token = re.sub(r"[^A-Za-z0-9.]+", "", token) or "device"
    return f"{world_size}x{token}"


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Fill the row's bound_us, efficiency and auto_vs_serial from its times (in place)."""
    times = row["times_us"]
    if times.get(COMPUTE) and times.get(COMM):
        row["bound_us"] = max(times[COMPUTE], times[COMM])
        row["efficiency"] = {
            k: row["bound_us"] / t for k, t in times.items() if k not in (COMPUTE, COMM, MM_PAIRED) and t
        }
        if times.get(MM_PAIRED) and times.get(AUTO_PAIRED):  # both from the same rounds: no drift between them
            row["efficiency"][AUTO_PAIRED] = max(times[MM_PAIRED], times[COMM]) / times[AUTO_PAIRED]
    if times.get(SERIAL) and times.get(AUTO):
        if times.get(SERIAL_PAIRED) and times.get(AUTO_PAIRED):
            row["auto_vs_serial"] = times[SERIAL_PAIRED] / times[AUTO_PAIRED]
        else:  # older rows: AUTO is the paired time where SERIAL_PAIRED exists
            row["auto_vs_serial"] = times.get(SERIAL_PAIRED, times[SERIAL]) / times[AUTO]
    return row


def columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """The time columns present in rows, in a fixed order (pipelined strategies in the middle)."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in [*row["times_us"], *row["skipped"]] if k not in keys]
    fixed_head = [COMPUTE, COMM, SERIAL, TORCH, TORCH_GRAPH]
    fixed_tail = [AUTO, AUTO_GRAPH]
    middle = [k for k in keys if k not in fixed_head + fixed_tail]
    return [k for k in fixed_head if k in keys] + middle + [k for k in fixed_tail if k in keys]


def _heading(key: str) -> str:
    return _HEADINGS.get(key, key.replace("asynctp_", "asynctp ").replace("_", " "))


def _us(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cells(row: dict[str, Any], keys: list[str]) -> list[str]:
    if row.get("error"):
        return [row["shape_set"], _label(row), *["-"] * (len(keys) + 4), "FAILED"]
    eff = row["efficiency"]
    return [
        row["shape_set"], _label(row), *[_us(row["times_us"].get(k)) for k in keys],
        _ratio(eff.get(AUTO)), _ratio(eff.get(AUTO_PAIRED)), _ratio(eff.get(AUTO_GRAPH)),
        _ratio(row.get("auto_vs_serial")),
        (row.get("auto_strategy") or "-") + (" (tuned)" if row.get("tuned_strategy") else ""),
    ]


def _label(row: dict[str, Any]) -> str:
    label = f"{row['layer']} {row['shape']}" if row.get("layer") else row["shape"]
    return label + (f" ({row['num_bs']} bs)" if row.get("num_bs", 1) > 1 else "")


def _header(keys: list[str]) -> list[str]:
    return ["set", "M x N x K", *[_heading(k) for k in keys], "eff auto", "eff auto paired", "eff auto graph",
            "serial / auto", "auto picks"]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table per op (times in microseconds), for the terminal."""
    blocks = []
    for op, op_rows in _by(rows, "op").items():
        keys = columns(op_rows)
        table = [_header(keys)] + [_cells(r, keys) for r in op_rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(line, widths)).rstrip() for line in table]
        blocks.append(f"{op} ({_dtype_words(op_rows[0])}, {op_rows[0]['hardware']}, times in us)\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def progress_line(row: dict[str, Any]) -> str:
    """One line per finished row while the run goes on."""
    head = f"{row['op']} {row['shape_set']} {_label(row)} {_dtype_words(row)}"
    if row.get("error"):
        return f"FAILED {head}: {row['error']}"
    t = row["times_us"]
    return (f"{head}: auto {_us(t.get(AUTO))} us ({row.get('auto_strategy')}), serial {_us(t.get(SERIAL))} us, "
            f"bound {_us(row.get('bound_us'))} us, efficiency {_ratio(row['efficiency'].get(AUTO))}")


def _by(rows: Iterable[dict[str, Any]], *fields: str) -> dict[Any, list[dict[str, Any]]]:
    groups: dict[Any, list[dict[str, Any]]] = {}
    for row in rows:
        key = row[fields[0]] if len(fields) == 1 else tuple(row[f] for f in fields)
        groups.setdefault(key, []).append(row)
    return groups


def results_stem(op: str, hardware: str) -> str:
    """`<op>_<hardware>`: the name of the .json / .md / .png that hold the latest rows of an op
    on some hardware (each row records its date)."""
    return f"{op}_{hardware}"


def _row_key(row: dict[str, Any]) -> tuple:
    return (row["shape_set"], row["layer"], row["shape"], row["num_bs"], row["dtype"])


def merge_rows(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """old with every row that new measures again replaced in place; new's other rows appended
    (so one day's runs of several shape sets end up in one file)."""
    fresh = {_row_key(r): r for r in new}
    merged = [fresh.pop(_row_key(r), r) for r in old]
    return merged + [r for r in new if _row_key(r) in fresh]


def write_results(rows: list[dict[str, Any]], out_dir: str | Path, *, figures: bool = True) -> list[Path]:
    """Write <stem>.json and .md per op (merged with the op's file on that hardware: a row
    replaces the older row of its shape), and with figures the .png and the directory's
    README.md. Returns the paths written. Writing the rows of a run one by one and then all
    together gives the same files (a run cut short keeps its rows)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for (op, hardware), group in _by(rows, "op", "hardware").items():
        stem = out / results_stem(op, hardware)
        path = stem.with_suffix(".json")
        old = json.loads(path.read_text())["rows"] if path.exists() else []
        merged = merge_rows(old, group)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"rows": merged}, indent=1) + "\n")
        tmp.replace(path)
        stem.with_suffix(".md").write_text(markdown(merged, title=True))
        written += [path, stem.with_suffix(".md")]
        if figures:
            from asynctp.bench.plot import plot_efficiency

            png = plot_efficiency(merged, stem.with_suffix(".png"))
            if png is not None:
                written.append(png)
    if figures:
        from asynctp.bench.index import write_readme

        written.append(write_readme(out))
    return written


def _md_table(rows: list[dict[str, Any]]) -> list[str]:
    keys = columns(rows)
    header = _header(keys)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cells(r, keys)) + " |" for r in rows]
    return lines


def _md_isolated(rows: list[dict[str, Any]]) -> list[str]:
    """Isolated calls (each starts on an idle GPU, ranks aligned): time, and host time in
    parentheses, per variant that was timed so."""
    keys = [k for k in columns(rows) if k not in (COMPUTE, COMM) and any(k in r.get("isolated_us", {}) for r in rows)]
    if not keys:
        return []
    lines = ["Isolated calls (GPU idle at each call's start): time (host time), us.", "",
             "| set | M x N x K | " + " | ".join(_heading(k) for k in keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for r in rows:
        iso, host = r.get("isolated_us", {}), r.get("host_us", {})
        cells = [f"{_us(iso.get(k))} ({_us(host.get(k))})" if k in iso else "-" for k in keys]
        lines.append(f"| {r['shape_set']} | {_label(r)} | " + " | ".join(cells) + " |")
    return lines + [""]


def _unique(rows: list[dict[str, Any]], field: str) -> list[str]:
    seen: list[str] = []
    for r in rows:
        if r.get(field) is not None and str(r[field]) not in seen:
            seen.append(str(r[field]))
    return seen


def is_scaled(op: str) -> bool:
    """An fp8 op (all_gather_scaled_matmul_*, scaled_matmul_reduce_scatter_*)."""
    return "scaled" in op


def _dtype_words(row: dict[str, Any]) -> str:
    """What the table's numbers compute in: a scaled (fp8) op's row records its output dtype."""
    if is_scaled(row["op"]):
        return f"float8_e4m3fn inputs, {row['dtype']} output"
    return row["dtype"]


def markdown(rows: list[dict[str, Any]], title: bool = False) -> str:
    """One op's rows as markdown: where they ran, the table, why any variant is missing."""
    first = rows[0]
    lines = [f"# {first['op']} on {first['hardware']}", ""] if title else []
    lines += [
        f"{first['world_size']} x {first['device']}, {_dtype_words(first)}, torch {', '.join(_unique(rows, 'torch'))}, "
        f"triton {', '.join(_unique(rows, 'triton')) or 'none'}, measured {', '.join(_unique(rows, 'date'))}, "
        f"median of {', '.join(_unique(rows, 'iters'))} iterations, slowest rank. Times in microseconds.",
        "",
        *[f"    {c}" for c in _unique(rows, "command")],
        "",
        *_md_table(rows),
        "",
        *_md_isolated(rows),
    ]
    notes = sorted({f"{_heading(k)}: {v}" for r in rows for k, v in r["skipped"].items()})
    notes += [f"{r['shape_set']} {_label(r)}: {r['error']}" for r in rows if r.get("error")]
    if notes:
        lines += ["Not measured:", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
