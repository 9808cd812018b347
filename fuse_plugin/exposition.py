"""The Prometheus text format (0.0.4), written out for the plugin's and the broker's
/metrics alike.

A dozen series do not need prometheus-client, whose import alone loads OpenSSL (memory on
every node: bench/README.md); and this module imports nothing, so the broker can write its metrics
without loading the plugin's gRPC side. Label values are escaped as the format demands
(backslash, double quote, newline): one of them is a container's cgroup path, which a
tenant can shape, and an unescaped quote or newline in it would make the whole scrape
unparseable or add series of the tenant's choosing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# One sample of a family: its labels (none for a plain series) and its value.
Sample = tuple[Mapping[str, str], float]
# One series of a histogram: its labels, its cumulative buckets (upper bound as written,
# "+Inf" last; count) and the sum of what it observed.
Series = tuple[Mapping[str, str], Sequence[tuple[str, int]], float]


def escape_label(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    """HELP text escapes backslash and newline only (a quote is plain text there)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def labels(pairs: Mapping[str, str]) -> str:
    """``{name="value",...}``, or nothing for no labels."""
    if not pairs:
        return ""
    return "{" + ",".join(f'{name}="{escape_label(value)}"'
                          for name, value in pairs.items()) + "}"


class Exposition:
    """One scrape's text: families added in order, then ``encode()``d."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lines: list[str] = []

    def family(self, name: str, kind: str, text: str, *samples: Sample) -> None:
        """A family's HELP and TYPE lines and its samples; ``name`` without the prefix."""
        full = f"{self._prefix}_{name}"
        self._lines.append(f"# HELP {full} {_escape_help(text)}")
        self._lines.append(f"# TYPE {full} {kind}")
        self._lines.extend(f"{full}{labels(pairs)} {float(value)!r}"
                           for pairs, value in samples)

    def histogram(self, name: str, text: str, *series: Series) -> None:
        """A histogram family: per series its ``_bucket`` lines, ``_sum`` and ``_count``."""
        full = f"{self._prefix}_{name}"
        self._lines.append(f"# HELP {full} {_escape_help(text)}")
        self._lines.append(f"# TYPE {full} histogram")
        for pairs, buckets, total in series:
            self._lines.extend(f"{full}_bucket{labels({**pairs, 'le': le})} {float(n)!r}"
                               for le, n in buckets)
            self._lines.append(f"{full}_sum{labels(pairs)} {float(total)!r}")
            self._lines.append(f"{full}_count{labels(pairs)} {float(buckets[-1][1])!r}")

    def encode(self) -> bytes:
        return ("\n".join(self._lines) + "\n").encode()
