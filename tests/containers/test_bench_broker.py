"""The broker benchmark's quick mode runs end to end in real containers and reports every
figure. No time is asserted (tests never do): the benchmark prints PASS/FAIL itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import broker as bench_broker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_quick_broker_benchmark_reports_every_figure(machine: None, tmp_path: Path) -> None:
    out = tmp_path / "broker.json"
    run = subprocess.run([sys.executable, "-m", "bench.broker", "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=580, check=False)
    assert run.returncode in (0, bench_broker.EXIT_TARGET_MISSED), run.stdout + run.stderr
    report = json.loads(out.read_text())
    for mode in ("direct", "broker"):
        for key in bench_broker.KEYS:
            samples = report["samples"][mode][key]
            assert samples
            assert all(value > 0 for value in samples)
    assert len(report["figures"]) == 5
    assert report["broker_side_mount_ms"]
    assert "mount latency" in run.stdout
