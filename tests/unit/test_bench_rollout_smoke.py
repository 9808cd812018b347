"""``python -m bench.rollout --quick`` runs and reports every figure. No time is
asserted: the figures are bench/README.md's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WAYS = ("one_socket", "surge", "handoff")
FIGURES = ("registered", "old_exit", "overlap", "unhealthy")


def test_quick_rollout_benchmark_reports_every_figure(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the fake node's FUSE device is made with mknod (CAP_MKNOD)")
    out = tmp_path / "rollout.json"
    run = subprocess.run([sys.executable, "-m", "bench.rollout", "--quick", "--out", str(out)],
                         check=False, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert result["mode"] == "quick"
    for way in WAYS:
        figure = result["figures"][way]
        for key in FIGURES:
            assert isinstance(figure[key]["median_ms"], (int, float)), (way, key)
        assert isinstance(figure["rejecting_runs"], int), way
    # The plugin ran with the DaemonSet's flags: its own socket, the hand-off.
    flags = result["serve_flags"]
    assert "--handoff-wait=20" in flags
    assert any(f.startswith("--instance=") for f in flags)
