"""tests/unit: the benchmark's records: derived fields, tables, result files, README (no ranks)."""

from __future__ import annotations

import json

import pytest
import torch

from asynctp.bench import index, report
from asynctp.bench.timing import capture_graph, median_us


def _row(m=4096, shape_set="seed", op="all_gather_matmul", hardware="2xH200", date="2026-11-20", **times):
    base = {"compute_bound": 373.0, "comm_bound": 188.0, "serial": 527.0, "torch_fused": 730.0,
            "torch_fused_graph": 434.0, "asynctp_pipeline": 400.0, "asynctp_auto": 400.0,
            "asynctp_auto_graph": 390.0}
    base.update(times)
    row = {
        "op": op, "shape_set": shape_set, "layer": "", "shape": f"{m}x3584x8192", "m": m, "n": 3584, "k": 8192,
        "num_bs": 1, "dtype": "bfloat16", "world_size": 2, "device": "NVIDIA H200", "hardware": hardware,
        "torch": "2.11.0", "triton": "3.6.0", "date": date, "command": "asynctp bench --shapes seed",
        "iters": 50, "warmup": 10, "tuned": False, "times_us": base, "skipped": {}, "bound_us": None,
        "efficiency": {}, "auto_strategy": "pipeline", "tuned_strategy": None, "auto_vs_serial": None, "error": None,
    }
    return report.derive(row)


def test_default_hardware_names():
    assert report.default_hardware("NVIDIA H200", 2) == "2xH200"
    assert report.default_hardware("NVIDIA H100 80GB HBM3", 8) == "8xH100"
    assert report.default_hardware("NVIDIA A100-SXM4-80GB", 4) == "4xA100"
    assert report.default_hardware("cpu", 2) == "2xcpu"


def test_derive_efficiency_and_ratio():
    row = _row()
    assert row["bound_us"] == 373.0
    assert row["efficiency"]["asynctp_auto"] == pytest.approx(373 / 400)
    assert row["efficiency"]["serial"] == pytest.approx(373 / 527)
    assert "compute_bound" not in row["efficiency"]
    assert row["auto_vs_serial"] == pytest.approx(527 / 400)
    # the pair's own times where the row has them; rows before them kept the paired auto in asynctp_auto
    assert _row(serial_paired=540.0, asynctp_auto_paired=410.0)["auto_vs_serial"] == pytest.approx(540 / 410)
    assert _row(serial_paired=540.0)["auto_vs_serial"] == pytest.approx(540 / 400)
    # auto's efficiency from its rounds with the local matmul: the rounds' own bound
    paired = _row(asynctp_auto_paired=410.0, compute_paired=390.0)
    assert paired["efficiency"]["asynctp_auto_paired"] == pytest.approx(390 / 410)
    assert "compute_paired" not in paired["efficiency"]
    assert _row(asynctp_auto_paired=410.0)["efficiency"]["asynctp_auto_paired"] == pytest.approx(373 / 410)  # (older rows)


def test_skipped_variants_have_no_efficiency():
    row = _row(torch_fused=None, torch_fused_graph=None)
    assert "torch_fused" not in row["efficiency"] and row["efficiency"]["serial"] > 0
    assert "| - | - |" in report.markdown([row])
    assert not [n for n in index.target_notes([row]) if "torch" in n]


def test_columns_put_new_strategies_between_torch_and_auto():
    row = _row(asynctp_async_input=350.0)
    keys = report.columns([row])
    assert keys[:5] == ["compute_bound", "comm_bound", "serial", "torch_fused", "torch_fused_graph"]
    assert keys[-2:] == ["asynctp_auto", "asynctp_auto_graph"]
    assert set(keys[5:-2]) == {"asynctp_pipeline", "asynctp_async_input"}


def test_tables_show_times_efficiency_and_failures():
    ok = _row()
    bad = _row(m=8192)
    bad.update(error="results differ from serial, row not timed: rank 1: strategy 'pipeline': ...", times_us={},
               efficiency={})
    text = report.format_table([ok, bad])
    assert "all_gather_matmul (bfloat16, 2xH200, times in us)" in text
    assert "527" in text and "0.93" in text and "1.32" in text and "FAILED" in text
    assert index.target_notes([ok, bad])[0] == "NOT met: 1 row(s) failed their check or did not run: seed 8192x3584x8192"
    md = report.markdown([ok, bad], title=True)
    assert md.startswith("# all_gather_matmul on 2xH200")
    assert "| seed | 4096x3584x8192 | 373 | 188 | 527 | 730 | 434 | 400 | 400 | 390 | 0.93 | - | 0.96 | 1.32 | pipeline |" in md
    assert "row not timed" in md and "    asynctp bench --shapes seed" in md
    assert "FAILED all_gather_matmul seed 8192x3584x8192" in report.progress_line(bad)


def test_fp8_ops_name_their_inputs_in_the_terminal():
    row = _row(op="all_gather_scaled_matmul_tensorwise")
    words = "float8_e4m3fn inputs, bfloat16 output"
    assert f"all_gather_scaled_matmul_tensorwise ({words}, 2xH200, times in us)" in report.format_table([row])
    assert report.progress_line(row).startswith(f"all_gather_scaled_matmul_tensorwise seed 4096x3584x8192 {words}: auto")
    assert words in report.markdown([row])


def test_merge_replaces_rows_measured_again():
    old = [_row(m=2048), _row(m=4096)]
    new = [_row(m=4096, serial=1.0), _row(m=256, shape_set="small")]
    merged = report.merge_rows(old, new)
    assert [r["m"] for r in merged] == [2048, 4096, 256]
    assert merged[1]["times_us"]["serial"] == 1.0


def test_write_results_and_readme(tmp_path):
    rows = [_row(m=m) for m in (2048, 4096, 8192)] + [_row(op="matmul_reduce_scatter")]
    written = report.write_results(rows, tmp_path)
    names = {p.name for p in written}
    assert {"all_gather_matmul_2xH200.json", "all_gather_matmul_2xH200.md",
            "matmul_reduce_scatter_2xH200.json", "README.md"} <= names
    data = json.loads((tmp_path / "all_gather_matmul_2xH200.json").read_text())
    assert [r["m"] for r in data["rows"]] == [2048, 4096, 8192]
    # a second run the same day, of another set, lands in the same file
    report.write_results([_row(m=256, shape_set="small")], tmp_path)
    data = json.loads((tmp_path / "all_gather_matmul_2xH200.json").read_text())
    assert [r["m"] for r in data["rows"]] == [2048, 4096, 8192, 256]
    readme = (tmp_path / "README.md").read_text()
    assert "## all_gather_matmul on 2xH200" in readme and "## matmul_reduce_scatter on 2xH200" in readme
    assert "met: eager auto efficiency >= 0.92 at seed M 4096/8192" in readme
    assert "met: eager auto faster than torch's fused op" in readme
    assert "python -m asynctp.cli bench --readme --out benchmarks/results" in readme


def test_readme_takes_the_newest_run_gpus_first(tmp_path):
    report.write_results([_row(date="2026-11-01", serial=999.0)], tmp_path)
    report.write_results([_row(date="2026-11-20", asynctp_auto=600.0)], tmp_path)
    report.write_results([_row(hardware="2xcpu", date="2026-11-21")], tmp_path)
    readme = index.write_readme(tmp_path).read_text()
    assert readme.index("on 2xH200") < readme.index("on 2xcpu")
    assert "999" not in readme  # the older H200 run is not shown
    assert "NOT met: serial / auto >= 0.98 at every shape (lowest 0.88, seed 4096x3584x8192)" in readme
    assert "NOT met: eager auto slower than torch's best at seed M 4096: 600 vs 434 us" in readme


def test_readme_without_results(tmp_path):
    assert "No results yet" in index.write_readme(tmp_path).read_text()


def test_cpu_timing_and_graph_refusal():
    calls = []
    assert median_us(lambda: calls.append(1), iters=5, warmup=2, device=torch.device("cpu")) >= 0
    assert len(calls) == 7
    with pytest.raises(ValueError, match="iters >= 1"):
        median_us(lambda: None, iters=0, warmup=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="requires a CUDA device"):
        capture_graph(lambda: None, torch.device("cpu"))


def test_regenerate_rewrites_markdown_and_readme_from_json(tmp_path):
    report.write_results([_row(m=2048), _row(m=4096)], tmp_path)
    md = tmp_path / "all_gather_matmul_2xH200.md"
    md.write_text("stale")
    (tmp_path / "README.md").write_text("stale")
    (tmp_path / "notes.json").write_text("{not json")  # ignored
    (tmp_path / "contention_2xH200.json").write_text('{"matmul_alone_us": 1.0}')  # no rows: ignored
    written = index.regenerate(tmp_path)
    assert md in written and (tmp_path / "README.md") in written
    assert md.read_text().startswith("# all_gather_matmul on 2xH200")
    assert "## all_gather_matmul on 2xH200" in (tmp_path / "README.md").read_text()


def test_fp8_and_bf16_rows_are_checked_against_one_target():
    # efficiency 373 / 410 = 0.91 misses 0.92; 373 / 400 = 0.93 meets it, for fp8 as for bf16
    fp8 = [_row(m=m, op="scaled_matmul_reduce_scatter_rowwise", asynctp_auto=410.0) for m in (4096, 8192)]
    bf16 = [_row(m=m, asynctp_auto=400.0) for m in (4096, 8192)]
    assert "NOT met: eager auto efficiency >= 0.92 at seed M 4096/8192 (4096: 0.91, 8192: 0.91)" in index.target_notes(fp8)
    assert "met: eager auto efficiency >= 0.92 at seed M 4096/8192 (4096: 0.93, 8192: 0.93)" in index.target_notes(bf16)
    assert index.target_efficiency("all_gather_scaled_matmul_tensorwise") == 0.92
    # rows with auto's rounds against the local matmul are checked by that efficiency
    paired = [_row(m=m, asynctp_auto=440.0, asynctp_auto_paired=400.0, compute_paired=372.0) for m in (4096, 8192)]
    assert ("met: eager auto efficiency (paired with mm only) >= 0.92 at seed M 4096/8192 (4096: 0.93, 8192: 0.93)"
            in index.target_notes(paired))


def test_fp8_tables_say_what_the_inputs_and_output_are():
    """A scaled op's row records its output dtype; the table must not read as a bf16 matmul."""
    fp8 = report.markdown([_row(op="all_gather_scaled_matmul_rowwise")], title=True)
    assert "2 x NVIDIA H200, float8_e4m3fn inputs, bfloat16 output, torch" in fp8
    assert "2 x NVIDIA H200, bfloat16, torch" in report.markdown([_row()], title=True)
