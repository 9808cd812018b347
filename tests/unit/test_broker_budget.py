"""The broker's log budget per tenant (fuse_plugin/broker/budget.py)."""

from __future__ import annotations

from fuse_plugin.broker import budget


def test_past_its_burst_a_tenant_is_counted_and_summed_up_once_per_interval() -> None:
    log = budget.LogBudget(burst=3, interval=10.0)
    admitted = [log.admit("/a", "path", f"reason {i}", 0.0) for i in range(10)]
    assert admitted == [True] * 3 + [False] * 7
    assert log.admit("/b", "path", "b's own", 0.0)  # another tenant has its own budget
    assert log.admit("/a", "option", "another kind", 0.0)
    assert log.due(9.9) == []
    assert log.due(10.0) == [budget.Summary("/a", "path", 7, 10.0, "reason 9")]
    assert log.admit("/a", "path", "a new interval", 10.5)


def test_stop_sums_up_what_is_left() -> None:
    log = budget.LogBudget(burst=1, interval=10.0)
    log.admit("/a", "busy", "x", 0.0)
    log.admit("/a", "busy", "y", 0.0)
    assert [s.suppressed for s in log.due(1.0, everything=True)] == [1]
    assert log.due(100.0) == []


def test_windows_end_in_the_order_they_started() -> None:
    """The loop asks every turn; windows are searched only up to the first still
    running, and each ends at its own time however many there are."""
    log = budget.LogBudget(burst=0, interval=10.0)
    for n in range(300):
        log.admit(f"/c{n}", "busy", "x", float(n))
    assert log.due(9.0) == []
    assert [s.container for s in log.due(12.0)] == ["/c0", "/c1", "/c2"]
    log.admit("/c0", "busy", "again", 299.0)  # a new window, after every other one
    assert [s.container for s in log.due(308.9)] == [f"/c{n}" for n in range(3, 299)]
    assert [s.container for s in log.due(309.0)] == ["/c299", "/c0"]
    assert log.due(400.0, everything=True) == []


def test_long_text_is_cut_with_a_marker_and_other_values_kept() -> None:
    long = "é" * 1000  # 2,000 bytes of UTF-8
    cut = budget.bounded(long)
    assert isinstance(cut, str)
    assert cut.endswith(f"...[{2000 - budget.FIELD_MAX} more bytes]")
    assert len(cut.encode()) < budget.FIELD_MAX + 40
    assert budget.bounded("short") == "short"
    assert budget.bounded(12) == 12
