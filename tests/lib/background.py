"""A step repeated on a thread until the block that started it ends: the pods created
every second through a rollout, the samplers beside a benchmark. One implementation of
the thread, its stop and its join, so each user says only what one step does."""

from __future__ import annotations

import threading
from typing import TypeVar

R = TypeVar("R", bound="Repeating")


class Repeating:
    """Calls ``step()`` every ``interval`` seconds on a daemon thread, from ``start()`` (or
    entering a ``with`` block) until ``stop()`` (or leaving it). A step that raises ends
    the thread: a step that can fail for a moment catches what it expects."""

    def __init__(self, interval: float, name: str, join_timeout: float = 30.0) -> None:
        self.interval, self.join_timeout = interval, join_timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def step(self) -> None:
        """One round of the work; subclasses say what."""
        raise NotImplementedError

    def _run(self) -> None:
        while not self._done.is_set():
            self.step()
            self._done.wait(self.interval)

    def start(self: R) -> R:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(self.join_timeout)

    def __enter__(self: R) -> R:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
