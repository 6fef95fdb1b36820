"""What a progressive load reports as it goes: one :class:`LoadEvent` per page and per milestone."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterator

EVENT_KINDS = ("anchor_page", "anchor_ready", "residual_page", "residual_ready", "residual_failed", "exact_ready",
               "exact_failed", "error")


@dataclass(frozen=True)
class LoadEvent:
    kind: str  # one of EVENT_KINDS
    t: float  # seconds since the load started
    layer: int | None = None
    page: int | None = None
    bytes: int = 0  # stored bytes of this page (page events)
    message: str | None = None  # residual_failed / exact_failed / error


class EventLog:
    """Every event of one load, in order, for any number of readers (:meth:`follow`), and an optional observer
    called with each (its exceptions are swallowed: a failing observer must not break the load)."""

    def __init__(self, observer: Callable[[LoadEvent], None] | None = None):
        self.observer = observer
        self._events: list[LoadEvent] = []
        self._cond = threading.Condition()
        self._finished = False  # no more events will come

    def emit(self, ev: LoadEvent) -> None:
        with self._cond:
            self._events.append(ev)
            self._cond.notify_all()
        if self.observer is not None:
            try:
                self.observer(ev)
            except Exception:  # noqa: BLE001
                pass

    def finish(self) -> None:
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def follow(self, timeout: float | None = None) -> Iterator[LoadEvent]:
        """Every event from the first, as it happens, until :meth:`finish`; TimeoutError after ``timeout``
        seconds without one."""
        i = 0
        while True:
            with self._cond:
                while i >= len(self._events) and not self._finished:
                    if not self._cond.wait(timeout):
                        raise TimeoutError("no load event within the timeout")
                batch = self._events[i:]
                finished = self._finished
            yield from batch
            i += len(batch)
            if finished and i >= len(self._events):
                return
