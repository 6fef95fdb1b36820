"""The decode side's loads: one progressive load per cache URL, shared by the requests that read it. No vLLM
import.

The proxy sends two requests for one prompt, one on the anchor and one on the full code; both name the same URL,
so the bytes cross the link once: the anchor request takes the load's anchor as soon as it lands, the full-code
request the full code once the residual is in. A load is closed, and its KV freed, once its full code has been
taken (the full-code request is the last to read it); until then it stays in a small LRU (``keep`` loads), so
that a request arriving after the other has taken the anchor still finds it, and the oldest is closed when a new
URL needs the room.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from lynxkv.cache.kv import KVPairs
from lynxkv.errors import InputError, LynxError
from lynxkv.stream.progressive import ProgressiveLoad, open_progressive

ANCHOR, FULL = "anchor", "full"
MODES = (ANCHOR, FULL)


class LoadFailed(LynxError):
    """A request's KV could not be loaded: no bytes in time, a corrupt cache, or another prompt's cache."""


class SharedLoads:
    """Progressive loads by URL (see the module docstring); thread-safe."""

    def __init__(self, keep: int = 8, opener: Callable[[str], ProgressiveLoad] | None = None):
        if keep < 1:
            raise InputError(f"keep: expected at least one load, got {keep}")
        self.keep = keep
        self._open = opener or (lambda url: open_progressive(url))
        self._loads: OrderedDict[str, ProgressiveLoad] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, url: str) -> ProgressiveLoad:
        """The load of ``url``, opened on first use."""
        with self._lock:
            load = self._loads.get(url)
            if load is not None:
                self._loads.move_to_end(url)
                return load
            load = self._open(url)
            self._loads[url] = load
            evicted = [self._loads.popitem(last=False)[1] for _ in range(len(self._loads) - self.keep)]
        for old in evicted:
            old.close()
        return load

    def forget(self, url: str) -> None:
        """Close the load of ``url`` (a failed one: the next request opens it afresh)."""
        with self._lock:
            load = self._loads.pop(url, None)
        if load is not None:
            load.close()

    def kv(self, url: str, mode: str, prompt: list[int], timeout: float) -> KVPairs:
        """The KV of the first ``len(prompt)`` tokens of ``url`` (the anchor or the full code), each layer's keys
        and values ``[kv_heads, tokens, head_dim]``, once it is in; a :class:`LoadFailed` if it is not within
        ``timeout`` seconds, the cache does not read, or it was not made from this prompt."""
        if mode not in MODES:
            raise InputError(f"lynx_mode: expected one of {', '.join(MODES)}, got {str(mode)[:40]!r}")
        load = self.load(url)
        try:
            if mode == ANCHOR:
                kv = load.wait_anchor(timeout)
            else:
                kv = load.residual.result(timeout)
        except (TimeoutError, LynxError, OSError) as exc:
            self.forget(url)
            what = "anchor" if mode == ANCHOR else "full code"
            raise LoadFailed(f"{url}: the {what} did not load within {timeout:g} s: {exc}") from None
        stored = load.prompt_token_ids
        if stored is None or list(stored[:len(prompt)]) != list(prompt) or len(stored) < len(prompt):
            raise LoadFailed(f"{url}: this cache was not made from the request's prompt")
        if mode == FULL:  # the full code is what a load is read for last: its KV goes once taken
            self.forget(url)
        return [(k[:, :len(prompt)], v[:, :len(prompt)]) for k, v in kv]

    def close(self) -> None:
        with self._lock:
            loads, self._loads = list(self._loads.values()), OrderedDict()
        for load in loads:
            load.close()
