"""The benchmark's quick mode runs end to end and reports every figure.

No time is asserted here (tests never assert wall-clock times): the benchmark itself
prints PASS/FAIL per target. This only checks that it runs against the real plugin and
the floor and that its JSON has every figure with a number in it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Exit codes of `python -m bench`: 0 all targets met, 3 some missed (both are a full run).
COMPLETED = (0, 3)
FIGURES = (
    "reregister", "reregister_received", "reregister_listed", "start",
    "health_unhealthy", "health_healthy", "allocate_sequential", "allocate_concurrent",
    "throughput_sequential", "throughput_concurrent", "allocate_cpu", "allocate_concurrent_cpu",
    "scale_10_list", "scale_10_allocate", "scale_1000_list", "scale_1000_allocate",
    "scale_10000_list", "scale_10000_allocate",
    "rss_start", "rss_deployed", "rss_allocates_done", "rss_restarts_done", "rss_growth",
    "rss_after_stress", "idle_cpu", "idle_python_cpu", "idle_cpu_beyond_floor",
)
FLOORED = ("reregister", "start", "health_unhealthy", "health_healthy",
           "allocate_sequential", "allocate_concurrent", "allocate_cpu", "throughput_concurrent",
           "scale_10000_list", "scale_10000_allocate", "rss_start", "rss_after_stress",
           "idle_cpu", "idle_python_cpu")
# Compared with the floor round by round: the ratio is reported with its quartiles.
RATIOS = ("allocate_sequential", "allocate_cpu", "throughput_concurrent")


@pytest.mark.timeout(300)
def test_quick_benchmark_reports_every_figure(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert run.returncode in COMPLETED, run.stdout + run.stderr
    assert f"JSON written to {out}" in run.stdout
    result = json.loads(out.read_text())
    assert result["mode"] == "quick"
    figures = result["figures"]
    assert set(FIGURES) <= set(figures), sorted(set(FIGURES) - set(figures))
    for key in FIGURES:
        assert isinstance(figures[key]["median"], (int, float)), key
    for key in FLOORED:
        assert isinstance(figures[key]["floor_median"], (int, float)), key
    targets = [key for key, figure in figures.items() if figure["target"]]
    assert all(isinstance(figures[key]["pass"], bool) for key in targets)
    assert len(targets) == result["passed"] + len(result["failed"])
    for key in ("median", "p99"):
        assert isinstance(figures["allocate_sequential"][key], float)
    for key in RATIOS:
        ratio = figures[key]["vs_floor"]
        assert ratio["q1"] <= ratio["median"] <= ratio["q3"], key
    # The plugin ran as the DaemonSet runs it (its metrics port moved to a free one).
    assert result["serve_flags"] == ["--metrics-port=9402"]
    assert figures["rss_deployed"]["figure"].endswith("scrapes")
