"""The PNG of a results file: efficiency per shape, one bar per variant (matplotlib, optional)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from asynctp.bench.report import AUTO, AUTO_GRAPH, COMM, COMPUTE, columns

__all__ = ["plot_efficiency"]

_NOTED = False


def _note_missing(exc: ImportError) -> None:
    global _NOTED
    if not _NOTED:
        print(f"asynctp bench: no PNG plot ({exc}); `pip install matplotlib` for one", file=sys.stderr)
        _NOTED = True


def plot_efficiency(rows: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Bar chart of max(compute, comm) / time per shape and variant; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        _note_missing(exc)
        return None
    rows = [r for r in rows if r.get("efficiency")]
    if not rows:
        return None
    keys = [k for k in columns(rows) if k not in (COMPUTE, COMM)]
    labels = [f"{r['shape_set']}\n{r['layer'] + ' ' if r['layer'] else ''}{r['shape']}" for r in rows]
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(min(30.0, max(6.0, 0.4 * len(rows) * len(keys))), 4.5))
    for i, key in enumerate(keys):
        xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(rows))]
        values = [r["efficiency"].get(key, 0.0) for r in rows]
        bold = key in (AUTO, AUTO_GRAPH)
        ax.bar(xs, values, width, label=key.replace("_", " "), edgecolor="black" if bold else None)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("max(mm only, comm only) / time")
    first = rows[0]
    ax.set_title(f"{first['op']}, {first['dtype']}, {first['hardware']} (higher is better, 1 = ideal overlap)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
