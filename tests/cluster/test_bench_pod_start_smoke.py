"""``python -m bench.pod_start --pods 2`` runs end to end on the cluster stage's node in
every mode and reports every figure: each FUSE pod mounted (none failed), the ratios, and
the usage of the components the mode deploys. No time is asserted: the figures are
bench/README.md's. The benchmark brings up a cluster of its own (taking the stage's
lock), so this test uses no cluster fixture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kubelet.node import skip_reason

ROOT = Path(__file__).resolve().parents[2]
# What each mode runs beside the pods: the plugin, the broker with it, the driver alone.
COMPONENTS = {"default": {"plugin"}, "broker": {"plugin", "broker"}, "dra": {"driver"},
              "dra-claim": {"driver"}}


def test_pod_start_benchmark_reports_every_figure_in_every_mode(tmp_path: Path) -> None:
    reason = skip_reason("the pod-start benchmark")
    if reason:
        pytest.skip(reason)
    out = tmp_path / "pod_start.json"
    run = subprocess.run([sys.executable, "-m", "bench.pod_start", "--pods", "2",
                          "--out", str(out)], check=False, cwd=ROOT, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["pods"] == 2
    for mode, components in COMPONENTS.items():
        figure = result["figures"][mode]
        assert figure["failed"] == [], (mode, figure)
        for kind in ("fuse", "plain"):
            assert figure[kind]["n"] == 2, (mode, kind, figure)
        for key in ("ratio_p50", "ratio_p99"):
            assert isinstance(figure[key], float), (mode, key, figure)
        assert set(figure["components"]) == components, (mode, figure)
        for usage in figure["components"].values():
            assert usage["max_rss_mib"] > 0, (mode, figure)
