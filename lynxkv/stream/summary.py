"""The numbers ``lynxkv stream`` reports: per-stream bytes, times and rates, and what a monolithic transfer of
the same cache would take on the same link.

Monolithic baselines (bytes for E = 2 x layers x kv_heads x tokens x head_dim elements):
- BF16: 2 bytes per element (the cache as the model holds it);
- INT8: 1 byte per element plus an fp16 scale and zero point per group of 64 (HF ``QuantizedCache`` style);
- INT4: 0.5 byte per element plus the same per-64 scale and zero point.
Each takes ``bytes / rate + latency``, where ``rate`` is the total rate measured during this transfer (the
link's, when one is emulated), so the comparison holds for the link the user actually has.
"""

from __future__ import annotations

GROUP = 64
MONOLITHIC_BYTES_PER_ELEMENT = {"bf16": 2.0, "int8": 1.0 + 4.0 / GROUP, "int4": 0.5 + 4.0 / GROUP}


def _rate(nbytes: int, first: float | None, last: float | None) -> float | None:
    if first is None or last is None or last <= first:
        return None
    return nbytes / (last - first)


def transfer_report(load, *, source: str) -> dict:
    """A JSON-ready summary of a finished (or failed) :class:`ProgressiveLoad`."""
    tl = load.timeline
    h = load.header
    link = tl.extra.get("link")
    out: dict = {
        "source": source,
        "residual_source": load.residual_url,
        "anchor_ready_s": tl.anchor_ready_s,
        "residual_ready_s": tl.residual_ready_s,
        "anchor_bytes": tl.anchor_bytes,
        "residual_bytes": tl.residual_bytes,
        "residual_failed": tl.residual_failed,
        "anchor_only": tl.residual_failed is not None,
        "retries": list(tl.extra.get("retries", [])),
    }
    if "exact_total_bytes" in tl.extra:  # the exact stage was read
        out.update(exact_source=getattr(load, "exact_url", None), exact_ready_s=tl.extra.get("exact_ready_s"),
                   exact_bytes=tl.extra.get("exact_bytes", 0), exact_failed=tl.extra.get("exact_failed"))
    if link is not None:
        out["link"] = {"bandwidth_bytes_per_s": link["bandwidth"], "latency_s": link["latency_s"]}
        out["anchor_rate"] = link["anchor"]["rate"]
        out["residual_rate"] = link["residual"]["rate"]
        if "exact_bytes" in out:
            out["exact_rate"] = link["exact"]["rate"]
        total_rate = link["total"]["rate"]
        latency = link["latency_s"]
    else:
        ex = tl.extra
        out["anchor_rate"] = _rate(tl.anchor_bytes, ex.get("anchor_first_s"), ex.get("anchor_arrived_s"))
        out["residual_rate"] = _rate(tl.residual_bytes, ex.get("residual_first_s"), ex.get("residual_arrived_s"))
        end = ex.get("residual_arrived_s") or ex.get("anchor_arrived_s")
        moved = tl.anchor_bytes + tl.residual_bytes
        if "exact_bytes" in out:
            out["exact_rate"] = _rate(out["exact_bytes"], ex.get("exact_first_s"), ex.get("exact_ready_s"))
            end, moved = ex.get("exact_ready_s") or end, moved + out["exact_bytes"]
        total_rate = _rate(moved, ex.get("anchor_first_s"), end)
        latency = 0.0
    out["total_rate"] = total_rate
    if h is not None:
        elements = 2 * h.layers * h.kv_heads * h.tokens * h.head_dim
        out["elements"] = elements
        out["monolithic"] = {}
        for name, bpe in MONOLITHIC_BYTES_PER_ELEMENT.items():
            nbytes = int(elements * bpe)
            out["monolithic"][name] = {"bytes": nbytes,
                                       "seconds": (nbytes / total_rate + latency) if total_rate else None}
    return out
