"""Moving a cache's segments between storage tiers (``lynxkv tier``).

Order of operations, so that a crash at any point leaves a usable cache under the old or the new name:
1. read both segments and check every header, index and page checksum of every segment -- the anchor's pages,
   and the residual's whether it is a file of its own or the second section of a single file (nothing damaged
   is ever copied);
2. publish the residual at its new location (atomic), read it back, check it page by page;
3. publish the anchor (with the residual's new location in its header when that changed), read it back and check
   it page by page;
4. only then delete the sources (unless ``keep``). If step 3 fails (a full disk), the residual copy of step 2,
   which no anchor names, is removed again.

:func:`relocate_residual` gives the anchor file's bytes with a new residual location in its header: the anchor
section (index and pages) is copied unchanged; only the header, whose length depends on the location string, is
rebuilt, and the anchor section's offset in the segment table follows it (the two-step packing the writer uses).
Page offsets in the index are relative to the section, so they stay valid.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Callable

from lynxkv.cache.replace import settle_dead_writers
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.headers import AnchorHeader, pack_anchor_header
from lynxkv.format.reader import PageReader
from lynxkv.storage import (
    BytesSource,
    can_remove,
    read_range,
    record_location,
    remove,
    resolve_location,
    same_object,
    size_of,
    write_atomic,
    writer_lock,
)

Progress = Callable[[str, int, int], None]


def anchor_header_of(anchor: bytes) -> AnchorHeader:
    return PageReader(BytesSource(anchor, "anchor")).header


def check_cache_bytes(anchor: bytes, residual: bytes | None = None) -> int:
    """Check every header, index and page CRC of a cache held in memory -- the anchor file ``anchor`` and, for a
    two-file cache, its residual file ``residual`` (``None``: the external residual is not checked); an inline
    residual is always checked. Return the number of pages checked; raise the first FormatError."""
    reader = PageReader(BytesSource(anchor, "anchor"))
    kinds = [c.SEGMENT_ANCHOR]
    if reader.residual_inline:
        reader.attach_residual()
        kinds.append(c.SEGMENT_RESIDUAL)
    elif residual is not None:
        reader.attach_residual(BytesSource(residual, "residual"))
        kinds.append(c.SEGMENT_RESIDUAL)
    pages = 0
    for kind in kinds:
        for _ in reader.pages(kind):
            pages += 1
    return pages


def relocate_residual(anchor: bytes, location: str) -> bytes:
    """The anchor file ``anchor`` with its external residual recorded at ``location`` (relative path or URL).

    A single file's inline residual becomes external: the result is the anchor file of a two-file cache whose
    residual file is the old residual section, byte for byte (spec/FORMAT.md §2)."""
    h = anchor_header_of(anchor)
    seg = h.segment(c.SEGMENT_RESIDUAL)
    if seg is None:
        raise InputError("this cache has no residual segment; there is no location to change")
    if len(location.encode("utf-8")) > c.MAX_LOCATION:
        raise InputError(f"residual location: at most {c.MAX_LOCATION} bytes")
    a_seg = h.segments[0]
    section = anchor[a_seg.offset:a_seg.offset + a_seg.length]

    def header(offset: int) -> AnchorHeader:
        segs = tuple(replace(s, offset=offset) if s.kind == c.SEGMENT_ANCHOR else
                     replace(s, placement=c.PLACEMENT_EXTERNAL, offset=0, location=location)
                     if s.kind == c.SEGMENT_RESIDUAL else s for s in h.segments)
        return replace(h, segments=segs)

    length = len(pack_anchor_header(header(0)))
    out = pack_anchor_header(header(length)) + section
    anchor_header_of(out)  # the rebuilt header must parse (and the file length be exact)
    return out


def _read(url: str, segment: str, progress: Progress | None, block: int = 8 << 20) -> bytes:
    total = size_of(url)
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


def _publish(url: str, data: bytes, check: Callable[[bytes], object]) -> int:
    """Write ``data`` to ``url`` atomically, read it back and check it; return its CRC-32."""
    write_atomic(url, data, make_dirs=True)
    back = read_range(url, 0, size_of(url))
    if back != data:
        raise InputError(f"{url}: the copy reads back as {len(back)} bytes that differ from the {len(data)} "
                         "bytes written")
    check(back)
    return crc32(data)


def move_cache(src: str, dst: str | None = None, *, residual_to: str | None = None, keep: bool = False,
               progress: Progress | None = None, allow_locations=()) -> dict:
    """Move (or with ``keep`` copy) the anchor to ``dst`` and/or the residual to ``residual_to``.

    The residual is found under the trust rule of :func:`lynxkv.storage.resolve_location` (``allow_locations``);
    a move whose source cannot be deleted afterwards (HTTP) is refused before anything is written. It holds the
    writer lock of ``src`` (:func:`lynxkv.storage.writer_lock`) and first settles what a killed writer of it left
    (:func:`lynxkv.cache.replace.settle_dead_writers`), while the anchor there still names the files it keeps."""
    with writer_lock(src) as lock:
        settle_dead_writers(lock, src)
        return _move_cache(src, dst, residual_to, keep, progress, allow_locations)


def _move_cache(src: str, dst: str | None, residual_to: str | None, keep: bool, progress, allow_locations) -> dict:
    new_anchor = dst or src
    anchor = _read(src, "anchor", progress)
    h = anchor_header_of(anchor)
    seg = h.segment(c.SEGMENT_RESIDUAL)
    external = seg is not None and seg.placement == c.PLACEMENT_EXTERNAL
    if residual_to and not external:
        raise InputError("this cache keeps its residual inside the anchor file; there is no residual to move")
    moved: dict = {}
    old_res = resolve_location(src, seg.location, allow=allow_locations) if external else None
    new_res = residual_to or old_res
    if not keep:
        for what, url, moves in (("anchor", src, not same_object(new_anchor, src)),
                                 ("residual", old_res, bool(residual_to) and not same_object(residual_to, old_res))):
            if moves and not can_remove(url):
                raise InputError(f"cannot delete the {what} at {url} after moving it ({url.split('://')[0]} "
                                 "storage is read-only here); pass --keep to copy instead")
    residual = None
    if external and residual_to and not same_object(residual_to, old_res):
        residual = _read(old_res, "residual", progress)
        check_cache_bytes(anchor, residual)
        crc = _publish(residual_to, residual, lambda back: check_cache_bytes(anchor, back))
        moved["residual"] = {"from": old_res, "to": residual_to, "bytes": len(residual), "crc32": crc}
    else:
        check_cache_bytes(anchor)
    location = record_location(new_anchor, new_res) if external else None
    if external and location != seg.location:
        anchor = relocate_residual(anchor, location)
    if not same_object(new_anchor, src) or external and location != seg.location:
        try:
            check_cache_bytes(anchor, residual)
            crc = _publish(new_anchor, anchor, lambda back: check_cache_bytes(back, residual))
        except BaseException:
            if "residual" in moved:  # the copy no anchor names (the source cache is untouched): not left behind
                with contextlib.suppress(Exception):
                    remove(residual_to)
            raise
        moved["anchor"] = {"from": src, "to": new_anchor, "bytes": len(anchor), "crc32": crc}
    if not keep:
        if "residual" in moved:
            remove(old_res)
        if "anchor" in moved and not same_object(new_anchor, src):
            remove(src)
    return {"anchor": new_anchor, "residual": new_res, "residual_location": location, "moved": moved}
