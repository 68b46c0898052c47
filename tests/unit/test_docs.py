"""The user-facing pages stay in step with the code: the README runs CI's test command verbatim and
shows Config's settings table, and benchmarks/results/ holds one result per op and hardware."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_readme_carries_ci_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = ci[ci.index(next(line for line in ci if "keep identical to README.md" in line)) + 1]
    assert f"    {command}\n" in README


def test_readme_is_a_page():
    assert len(README.splitlines()) <= 150


def test_readme_settings_table_is_configs():
    from asynctp.config import settings_table

    assert settings_table().strip() in README, "regenerate README's table: asynctp.config.settings_table()"


def test_results_are_named_by_op_and_hardware():
    results = ROOT / "benchmarks" / "results"
    # what the repository holds: the README's demo command writes its own record there too
    # (demo_2xcpu.json), which must not fail the README's test command run after it
    listed = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        files = [ROOT / line for line in listed.stdout.splitlines()]
    else:  # not a git checkout
        files = [p for p in results.rglob("*") if p.is_file()]
    assert len(files) <= 80, f"benchmarks/results holds {len(files)} files (at most 80)"
    assert all(p.parent == results for p in files), "benchmarks/results has no subfolders"
    dated = [p.name for p in files if re.search(r"\d{4}-\d{2}-\d{2}", p.name)]
    assert not dated, f"results named by date (the date lives inside): {dated}"
