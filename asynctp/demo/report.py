"""The demo's outputs: the side-by-side table, the JSON record and the loss-curve PNG."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["table", "comparison", "loss_notes", "write_json", "write_png", "versions", "LOSS_AGREEMENT"]

# bf16 agreement: a loss curve within this relative difference of vanilla TP's per step
LOSS_AGREEMENT = 1e-2


def _memory(field: str) -> Any:
    def fmt(run: dict[str, Any]) -> str:
        nbytes = run.get(field)
        if nbytes is not None:
            return f"{nbytes / 2**30:.2f} GiB"
        return f"n/a ({run.get('peak_memory_missing', 'cpu')})"

    return fmt


def table(runs: list[dict[str, Any]]) -> str:
    rows = [
        ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"),
        ("step time", lambda r: f"{r['step_time_s'] * 1000:.1f} ms"),
        # the host's share: near the step time, the GPU waited for Python (host-bound)
        ("host time", lambda r: f"{r['host_time_s'] * 1000:.1f} ms" if r.get("host_time_s") is not None else "-"),
        ("peak memory", _memory("peak_memory_bytes")),  # tensors
        ("peak reserved", _memory("peak_reserved_bytes")),  # what the process held: CUDA-graph pools too
        ("final loss", lambda r: "- (no comm)" if r.get("no_comm") else f"{r['final_loss']:.4f}"),
    ]
    if any(r.get("profile") for r in runs):
        rows.append(("exposed comm", lambda r: f"{r['profile']['exposed_comm_ms']:.1f} ms/step" if r.get("profile") else "-"))
        rows.append(("comm (total)", lambda r: f"{r['profile']['comm_ms']:.1f} ms/step" if r.get("profile") else "-"))
        # the rest of the profiled wall the GPU idled or sat in stream waits (on a peer's signal)
        rows.append(("GPU busy / wall", lambda r: f"{r['profile']['busy_ms']:.1f} / {r['profile']['wall_ms']:.1f} ms"
                     if (r.get("profile") or {}).get("busy_ms") is not None else "-"))
    header = [""] + [r["name"] for r in runs]
    body = [[label] + [fmt(r) for r in runs] for label, fmt in rows]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
             for line in [header] + body]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def comparison(vanilla: dict[str, Any], other: dict[str, Any], no_comm: dict[str, Any] | None = None) -> dict[str, Any]:
    """Speed-up, loss-curve agreement and the share of vanilla's exposed communication that the
    other run recovered: measured by the no-communication run when there is one (vanilla's step
    time minus that run's: what communication costs vanilla TP in step time, waits, skew and
    host work included), and by the profile (kernel intervals) when there is one."""
    diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(vanilla["losses"], other["losses"])]
    out: dict[str, Any] = {
        "speedup": vanilla["step_time_s"] / other["step_time_s"],
        "step_time_saved_ms": (vanilla["step_time_s"] - other["step_time_s"]) * 1000,
        "max_rel_loss_diff": max(diffs) if diffs else 0.0,
    }
    exposed = (vanilla.get("profile") or {}).get("exposed_comm_ms")
    if exposed:
        out["vanilla_exposed_comm_ms"] = exposed
        out["recovered_fraction_of_exposed_comm"] = out["step_time_saved_ms"] / exposed
    if no_comm is not None:
        floor = (vanilla["step_time_s"] - no_comm["step_time_s"]) * 1000
        out["vanilla_comm_cost_ms"] = floor
        if floor > 0:
            out["recovered_fraction_of_comm_cost"] = out["step_time_saved_ms"] / floor
    return out


def loss_notes(base: str, compared: dict[str, dict[str, Any]], batch_size: int) -> list[str]:
    """A line for each run whose loss curve left `base`'s by more than LOSS_AGREEMENT: how far,
    and what rounding alone does (the --control run, when there is one). Printed, never silent:
    a curve that leaves vanilla's may be rounding over many steps, or wrong gradients."""
    from asynctp.demo.train import VARIANTS

    control_name, torch_pass_name = VARIANTS["control"].name, VARIANTS["torch-async-tp"].name
    control = compared.get(control_name)
    notes = []
    for name, c in compared.items():
        diff = c.get("max_rel_loss_diff", 0.0)
        if name == control_name or not diff > LOSS_AGREEMENT:
            continue
        line = f"note: {name}'s loss curve left {base}'s by {diff:.2e} at some step (> {LOSS_AGREEMENT:g}); "
        line += (f"rounding alone (the 1-ulp control) moved it by {control['max_rel_loss_diff']:.2e}" if control
                 else "add --control to see how far rounding alone moves it")
        if name == torch_pass_name and batch_size > 1:
            line += ("; torch 2.11's async-TP pass computed wrong gradients for this model at batch > 1 (it feeds "
                     "cuDNN's attention backward a strided gradient that cuDNN 9.19 gets wrong; turning cuDNN attention "
                     "off avoids it; benchmarks/probe_torch_async_tp_numerics.py checks a torch release)")
        notes.append(line)
    return notes


def versions() -> dict[str, str]:
    import asynctp

    found = {"python": platform.python_version(), "torch": torch.__version__, "asynctp": asynctp.__version__}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "not installed"
    if torch.cuda.is_available():
        found["cuda"] = str(torch.version.cuda)
        found["gpu"] = torch.cuda.get_device_name(0)
    return found


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")


def write_png(path: Path, runs: list[dict[str, Any]], title: str) -> str | None:
    """The loss curves of every run; returns why it was skipped (None when written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'asynctp[demo]')"
    fig, ax = plt.subplots(figsize=(7, 4))
    shown = [r for r in runs if not r.get("no_comm")]  # its losses come from skipped collectives
    for run, style in zip(shown, ("-", "--", ":", "-.")):
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], style, label=run["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
