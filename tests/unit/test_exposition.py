"""The one Prometheus text writer, as Prometheus's own parser reads it back."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from fuse_plugin.exposition import Exposition, escape_label


def test_a_label_value_with_quotes_backslashes_and_newlines_reads_back_as_written() -> None:
    """A cgroup path is the tenant's to shape: a quote or newline left as it is broke the
    scrape (the plugin's writer never escaped; the broker's did)."""
    hostile = 'a"b\\c\nd} 1\nfake_total 9'
    out = Exposition("x")
    out.family("held", "gauge", "Held\\by\nwhom", ({"cgroup": hostile}, 2), ({}, 3))
    families = list(text_string_to_metric_families(out.encode().decode()))
    assert [f.name for f in families] == ["x_held"]
    assert [(s.labels, s.value) for s in families[0].samples] == [
        ({"cgroup": hostile}, 2.0), ({}, 3.0)]
    assert families[0].documentation == "Held\\by\nwhom"


def test_escape_label_follows_the_text_format() -> None:
    assert escape_label('\\"\n') == '\\\\\\"\\n'
    assert escape_label("plain") == "plain"
