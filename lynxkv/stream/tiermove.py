"""Moving a cache's segments between storage tiers (``lynxkv tier``).

Order of operations, so that a crash at any point leaves a usable cache under the old or the new name:
1. read both segments and check every header, index and page checksum (nothing damaged is ever copied);
2. publish the residual at its new location (atomic), read it back, compare CRC-32;
3. publish the anchor (with the residual's new location in its header when that changed), read it back;
4. only then delete the sources (unless ``keep``).
"""

from __future__ import annotations

import os
import posixpath
import zlib
from typing import Callable

from lynxkv.errors import ChecksumError, InputError
from lynxkv.format import constants as c
from lynxkv.stream.relocate import anchor_header_of, check_segment_bytes, relocate_residual
from lynxkv.stream.tiers import (
    filesystem,
    has_protocol,
    is_local,
    local_path,
    protocol_of,
    read_range,
    resolve_location,
    segment_size,
    write_bytes_atomic,
)

Progress = Callable[[str, int, int], None]


def _read(url: str, segment: str, progress: Progress | None, block: int = 8 << 20) -> bytes:
    total = segment_size(url)
    buf = bytearray()
    while len(buf) < total:
        part = read_range(url, len(buf), min(total, len(buf) + block))
        if not part:
            raise InputError(f"{url}: ended at byte {len(buf)} of {total}")
        buf += part
        if progress:
            progress(segment, len(buf), total)
    if progress and not total:
        progress(segment, 0, 0)
    return bytes(buf)


def _publish(url: str, data: bytes) -> int:
    write_bytes_atomic(url, data)
    back = read_range(url, 0, segment_size(url))
    crc = zlib.crc32(data)
    if zlib.crc32(back) != crc or len(back) != len(data):
        raise ChecksumError(f"{url}: the copy reads back as {len(back)} bytes with CRC-32 {zlib.crc32(back):08x}, "
                            f"expected {len(data)} bytes with {crc:08x}", field="crc32", where=url)
    return crc


def _canonical(url: str) -> str:
    return os.path.abspath(local_path(url)) if is_local(url) else url


def location_for(anchor_url: str, residual_url: str) -> str:
    """How the anchor at ``anchor_url`` should record a residual at ``residual_url``: a relative path when both
    live in the same place (same local disk, same bucket), otherwise the absolute path or URL."""
    if is_local(anchor_url) and is_local(residual_url):
        return os.path.relpath(_canonical(residual_url), os.path.dirname(_canonical(anchor_url)))
    if has_protocol(anchor_url) and has_protocol(residual_url) and protocol_of(anchor_url) == protocol_of(residual_url):
        a, r = anchor_url.split("://", 1)[1], residual_url.split("://", 1)[1]
        if a.split("/", 1)[0] == r.split("/", 1)[0]:  # same bucket / host
            return posixpath.relpath(r, posixpath.dirname(a))
    return _canonical(residual_url)


def _remove(url: str) -> None:
    if is_local(url):
        os.unlink(local_path(url))
    else:
        fs, path = filesystem(url)
        fs.rm(path)


def move_cache(src: str, dst: str | None = None, *, residual_to: str | None = None, keep: bool = False,
               progress: Progress | None = None) -> dict:
    """Move (or with ``keep`` copy) the anchor to ``dst`` and/or the residual to ``residual_to``."""
    new_anchor = dst or src
    anchor = _read(src, "anchor", progress)
    check_segment_bytes("anchor", anchor)
    h = anchor_header_of(anchor)
    seg = h.segment(c.SEGMENT_RESIDUAL)
    external = seg is not None and seg.placement == c.PLACEMENT_EXTERNAL
    if residual_to and not external:
        raise InputError("this cache keeps its residual inside the anchor file; there is no residual to move")
    moved: dict = {}
    old_res = resolve_location(src, seg.location) if external else None
    new_res = residual_to or old_res
    if external and residual_to and _canonical(residual_to) != _canonical(old_res):
        data = _read(old_res, "residual", progress)
        check_segment_bytes("residual", data, anchor)
        crc = _publish(residual_to, data)
        moved["residual"] = {"from": old_res, "to": residual_to, "bytes": len(data), "crc32": crc}
    location = location_for(new_anchor, new_res) if external else None
    if external and location != seg.location:
        anchor = relocate_residual(anchor, location)
    if _canonical(new_anchor) != _canonical(src) or external and location != seg.location:
        check_segment_bytes("anchor", anchor)
        crc = _publish(new_anchor, anchor)
        moved["anchor"] = {"from": src, "to": new_anchor, "bytes": len(anchor), "crc32": crc}
    if not keep:
        if "residual" in moved:
            _remove(old_res)
        if "anchor" in moved and _canonical(new_anchor) != _canonical(src):
            _remove(src)
    return {"anchor": new_anchor, "residual": new_res, "residual_location": location, "moved": moved}
