"""``python -m bench.dra --quick`` runs end to end against the real driver and the real
plugin and reports every figure (no time is asserted: the benchmark reports them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = ("dra_start", "prepare_direct", "unprepare_direct", "prepare_broker",
           "unprepare_broker", "prepare_recorded", "prepare_after_restart", "serve_allocate")
NUMBERS = ("dra_rss_start_mib", "dra_rss_after_calls_mib", "serve_rss_start_mib",
           "serve_rss_after_calls_mib")


@pytest.mark.timeout(180)
def test_quick_dra_benchmark_reports_every_figure(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    out = tmp_path / "dra.json"
    run = subprocess.run([sys.executable, "-m", "bench.dra", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())["figures"]
    for key in TIMINGS:
        assert figures[key]["n"] >= 1, key
        assert figures[key]["median_ms"] > 0, key
    for key in NUMBERS:
        assert figures[key] > 0, key
    for who in ("dra_idle", "serve_idle"):
        assert figures[who]["threads"] >= 1
    assert "dra: NodePrepareResources, broker" in run.stdout
    assert figures["dra_api_requests_per_min_idle"] >= 0
