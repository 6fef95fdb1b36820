"""What a progressive load reports as it goes: one :class:`LoadEvent` per page and per milestone."""

from __future__ import annotations

from dataclasses import dataclass

EVENT_KINDS = ("anchor_page", "anchor_ready", "residual_page", "residual_ready", "residual_failed", "error")


@dataclass(frozen=True)
class LoadEvent:
    kind: str  # one of EVENT_KINDS
    t: float  # seconds since the load started
    layer: int | None = None
    page: int | None = None
    bytes: int = 0  # stored bytes of this page (page events)
    message: str | None = None  # residual_failed / error
