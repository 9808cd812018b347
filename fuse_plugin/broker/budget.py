"""How much the broker writes about one tenant.

A tenant sending refused requests as fast as it can would make a broker that logs every
request fill the node's logs at the rate it can refuse (docs/security.md's table has
what the old broker wrote). So each container gets ``BURST`` lines per kind of refusal (and of
failure) per ``INTERVAL``; past that its requests are counted, not logged, and when the
interval ends one ``broker.refused_summary`` line says how many of each kind were not
logged, with the last reason. The metrics still count every refusal (``stats``), and the
log's lines plus its summaries account for every request. Every text field of a line is
cut to ``FIELD_MAX`` bytes with a marker saying how much was cut, so a line is bounded too.
"""

from __future__ import annotations

from dataclasses import dataclass

BURST = 20  # lines per container and kind in an interval, before summing up
INTERVAL = 10.0  # seconds
FIELD_MAX = 256  # bytes of any one text field in a line


@dataclass
class _Window:
    start: float
    logged: int = 0
    suppressed: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Summary:
    """What one container's refusals of one kind were, unlogged, in one interval."""

    container: str
    kind: str
    suppressed: int
    seconds: float
    reason: str


class LogBudget:
    """Per (container, kind) windows; used by the broker's loop thread only."""

    def __init__(self, burst: int = BURST, interval: float = INTERVAL) -> None:
        self.burst = burst
        self.interval = interval
        self._windows: dict[tuple[str, str], _Window] = {}

    def admit(self, container: str, kind: str, reason: str, now: float) -> bool:
        """Whether this line may be written; if not, it is counted for the summary."""
        window = self._windows.setdefault((container, kind), _Window(now))
        if window.logged < self.burst:
            window.logged += 1
            return True
        window.suppressed += 1
        window.reason = reason
        return False

    def due(self, now: float, everything: bool = False) -> list[Summary]:
        """The summaries of windows that have ended (all of them with ``everything``, at
        stop); ended windows are forgotten, so the budget holds only active tenants.
        Windows are kept in the order they started (a new one is added at the end), so
        the first one still running ends the search: the loop asks every turn, and a
        full node has hundreds of containers with a window open."""
        out = []
        while self._windows:
            key, window = next(iter(self._windows.items()))
            if not everything and now - window.start < self.interval:
                break
            del self._windows[key]
            if window.suppressed:
                out.append(Summary(key[0], key[1], window.suppressed,
                                   round(now - window.start, 1), window.reason))
        return out


def bounded(value: object) -> object:
    """A text field cut to ``FIELD_MAX`` bytes of UTF-8, saying how many were cut; other
    values as they are."""
    if not isinstance(value, str):
        return value
    data = value.encode(errors="replace")
    if len(data) <= FIELD_MAX:
        return value
    return (data[:FIELD_MAX].decode(errors="ignore")
            + f"...[{len(data) - FIELD_MAX} more bytes]")
