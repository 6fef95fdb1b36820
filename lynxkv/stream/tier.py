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

from lynxkv.cache.replace import names_residual, settle_dead_writers
from lynxkv.errors import InputError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.format.headers import AnchorHeader, pack_anchor_header
from lynxkv.format.reader import PageReader
from lynxkv.storage import (
    BytesSource,
    can_remove,
    exists,
    has_protocol,
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


def check_cache_bytes(anchor: bytes, residual: bytes | None = None, exact: bytes | None = None, *,
                      decode: bool = True) -> int:
    """Check every header, index and page CRC of a cache held in memory -- the anchor file ``anchor`` and, for a
    two-file cache, its residual file ``residual`` and its exact file ``exact`` (``None``: that external segment is
    not checked); an inline residual or exact segment is always checked. An exact segment's header must belong to
    the anchor (cache id, shape, dtype). ``decode``: also decode every anchor and residual record (finite metadata,
    record layout, padding), as a load would; ``False`` checks the CRCs only (a server that just moves bytes).
    Return the number of pages checked; raise the first FormatError."""
    wrap = (lambda data, name: None if data is None else BytesSource(data, name))
    return check_cache_sources(wrap(anchor, "anchor"), wrap(residual, "residual"), wrap(exact, "exact"),
                               decode=decode)


def check_cache_sources(anchor, residual=None, exact=None, *, decode: bool = True) -> int:
    """:func:`check_cache_bytes` over byte sources (:mod:`lynxkv.storage.sources`): page by page, so that a file
    read through one is never held whole."""
    reader = PageReader(anchor)
    kinds = [c.SEGMENT_ANCHOR]
    if reader.residual_inline:
        reader.attach_residual()
        kinds.append(c.SEGMENT_RESIDUAL)
    elif residual is not None:
        reader.attach_residual(residual)
        kinds.append(c.SEGMENT_RESIDUAL)
    if reader.exact_inline:
        reader.attach_exact()
        kinds.append(c.SEGMENT_EXACT)
    elif exact is not None:
        reader.attach_exact(exact)
        kinds.append(c.SEGMENT_EXACT)
    pages = 0
    for kind in kinds:
        for _ in reader.pages(kind, decode=decode):
            pages += 1
    return pages


def relocate_segments(anchor: bytes, locations: dict[int, str]) -> bytes:
    """The anchor file ``anchor`` with each segment kind of ``locations`` (residual, exact) recorded as external at
    its location (relative path or URL).

    An inline section that becomes external is left out of the result (its bytes, byte for byte, are what its
    own file holds: spec/FORMAT.md §2); every other inline section is copied unchanged, in table order. Only the
    header, whose length depends on the location strings, is rebuilt, and the inline sections' offsets follow it
    (the two-step packing the writer uses). Page offsets in an index are relative to their section, so they stay
    valid."""
    h = anchor_header_of(anchor)
    for kind, location in locations.items():
        name = c.SEGMENT_KINDS.get(kind, kind)
        if h.segment(kind) is None:
            raise InputError(f"this cache has no {name} segment; there is no location to change")
        if len(location.encode("utf-8")) > c.MAX_LOCATION:
            raise InputError(f"{name} location: at most {c.MAX_LOCATION} bytes")
    kept = [s for s in h.segments if s.kind not in locations and s.placement == c.PLACEMENT_INLINE]
    sections = [anchor[s.offset:s.offset + s.length] for s in kept]

    def header(start: int) -> AnchorHeader:
        offsets, at = {}, start
        for s in kept:
            offsets[s.kind], at = at, at + s.length
        segs = tuple(replace(s, placement=c.PLACEMENT_EXTERNAL, offset=0, location=locations[s.kind])
                     if s.kind in locations else replace(s, offset=offsets[s.kind]) if s.kind in offsets else s
                     for s in h.segments)
        return replace(h, segments=segs)

    length = len(pack_anchor_header(header(0)))
    out = pack_anchor_header(header(length)) + b"".join(sections)
    anchor_header_of(out)  # the rebuilt header must parse (and the file length be exact)
    return out


def relocate_residual(anchor: bytes, location: str) -> bytes:
    """The anchor file ``anchor`` with its residual recorded at ``location`` (:func:`relocate_segments`): a single
    file's inline residual becomes external, the residual file being the old residual section byte for byte."""
    return relocate_segments(anchor, {c.SEGMENT_RESIDUAL: location})


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


_SIDES = ((c.SEGMENT_RESIDUAL, "residual"), (c.SEGMENT_EXACT, "exact"))


def move_cache(src: str, dst: str | None = None, *, residual_to: str | None = None, exact_to: str | None = None,
               keep: bool = False, progress: Progress | None = None, allow_locations=()) -> dict:
    """Move (or with ``keep`` copy) the anchor to ``dst``, the residual to ``residual_to`` and/or the exact
    segment to ``exact_to``.

    A side segment is found under the trust rule of :func:`lynxkv.storage.resolve_location` (``allow_locations``)
    when it moves or when the anchor does (its recorded location is then rewritten relative to the new anchor); a
    move whose source cannot be deleted afterwards (HTTP) is refused before anything is written. It holds the
    writer locks of ``src`` and of ``dst`` (:func:`lynxkv.storage.writer_lock`, taken in the order of their paths)
    and first settles what a killed writer of either left (:func:`lynxkv.cache.replace.settle_dead_writers`),
    while the anchors there still name the files they keep. Before a segment's copy is created it is noted in the
    journal of the anchor that will name it, and a segment to be removed in the journal of ``src``: a move killed
    at any point leaves each anchor naming files that exist, and the next writer removes the copies and the
    sources that no anchor names."""
    paths = sorted({src} | ({dst} if dst and not same_object(dst, src) else set()))
    with contextlib.ExitStack() as stack:
        locks = {}
        for p in paths:
            locks[p] = stack.enter_context(writer_lock(p, make_dirs=p != src))
            settle_dead_writers(locks[p], p)
        return _move_cache(src, dst, {c.SEGMENT_RESIDUAL: residual_to, c.SEGMENT_EXACT: exact_to}, keep, progress,
                           allow_locations, locks[src], locks.get(dst, locks[src]) if dst else locks[src])


def _move_cache(src: str, dst: str | None, targets: dict, keep: bool, progress, allow_locations, src_lock,
                dst_lock) -> dict:
    new_anchor = dst or src
    anchor_moves = not same_object(new_anchor, src)
    anchor = _read(src, "anchor", progress)
    h = anchor_header_of(anchor)
    side: dict[int, dict] = {}  # per external side segment: its entry, old and new place, whether it moves
    for kind, name in _SIDES:
        seg, to = h.segment(kind), targets[kind]
        external = seg is not None and seg.placement == c.PLACEMENT_EXTERNAL
        if to and seg is None:
            raise InputError(f"this cache has no {name} segment; there is nothing to move")
        if to and not external:
            raise InputError(f"this cache keeps its {name} inside the anchor file; there is no {name} to move")
        if not external:
            continue
        old = resolve_location(src, seg.location, allow=allow_locations, what=name) \
            if to or anchor_moves or kind == c.SEGMENT_RESIDUAL else None
        side[kind] = {"name": name, "seg": seg, "old": old, "new": to or old,
                      "moves": bool(to) and not same_object(to, old)}
    if not keep:
        for what, url, moves in [("anchor", src, anchor_moves)] + [(d["name"], d["old"], d["moves"])
                                                                   for d in side.values()]:
            if moves and not can_remove(url):
                raise InputError(f"cannot delete the {what} at {url} after moving it ({url.split('://')[0]} "
                                 "storage is read-only here); pass --keep to copy instead")
    moved: dict = {}
    data: dict[int, bytes | None] = {c.SEGMENT_RESIDUAL: None, c.SEGMENT_EXACT: None}
    for kind, d in side.items():
        if d["moves"]:
            data[kind] = _read(d["old"], d["name"], progress)
    check_cache_bytes(anchor, data[c.SEGMENT_RESIDUAL], data[c.SEGMENT_EXACT])  # nothing damaged is copied
    for kind, d in side.items():  # every note before the first file
        if d["moves"]:
            if not has_protocol(d["new"]):
                dst_lock.note("new" if not exists(d["new"]) else "tmp", d["new"])
            if not keep and not has_protocol(d["old"]):
                src_lock.note("old", d["old"])
    published: list[str] = []
    try:
        for kind, d in side.items():  # the side segments first: an anchor never names a missing one
            if not d["moves"]:
                continue
            payload = data[kind]
            crc = _publish(d["new"], payload, lambda back, k=kind: check_cache_bytes(
                anchor, back if k == c.SEGMENT_RESIDUAL else None, back if k == c.SEGMENT_EXACT else None))
            published.append(d["new"])
            moved[d["name"]] = {"from": d["old"], "to": d["new"], "bytes": len(payload), "crc32": crc}
        locations = {kind: record_location(new_anchor, d["new"]) for kind, d in side.items()
                     if d["new"] is not None}
        changed = {kind: loc for kind, loc in locations.items() if loc != side[kind]["seg"].location}
        if changed:
            anchor = relocate_segments(anchor, changed)
        if anchor_moves or changed:
            check_cache_bytes(anchor, data[c.SEGMENT_RESIDUAL], data[c.SEGMENT_EXACT])
            crc = _publish(new_anchor, anchor, lambda back: check_cache_bytes(back, data[c.SEGMENT_RESIDUAL],
                                                                              data[c.SEGMENT_EXACT]))
            moved["anchor"] = {"from": src, "to": new_anchor, "bytes": len(anchor), "crc32": crc}
    except BaseException:
        for url in published:  # copies no anchor names (the source cache is untouched): not left behind; one
            if names_residual(new_anchor, url) is False:  # the published anchor names (its read-back failed) stays
                with contextlib.suppress(Exception):
                    remove(url)
        raise
    if not keep:
        for kind, d in side.items():
            if d["moves"]:
                remove(d["old"])
        if "anchor" in moved and anchor_moves:
            remove(src)
    res, ex = side.get(c.SEGMENT_RESIDUAL), side.get(c.SEGMENT_EXACT)
    return {"anchor": new_anchor, "residual": res["new"] if res else None,
            "residual_location": locations.get(c.SEGMENT_RESIDUAL),
            "exact": ex["new"] if ex else None, "exact_location": locations.get(c.SEGMENT_EXACT),
            "moved": moved}
