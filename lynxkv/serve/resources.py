"""What ``lynxkv serve`` serves: the anchor, the residual and the exact segment of one cache as separate resources,
checked first.

Resources. The anchor file is ``GET /<anchor file name>``; an external residual is ``GET /<location>`` where
``<location>`` is the relative location its anchor header records, so the URL of the anchor is all a client
needs (``open_progressive("http://host:port/x.lynx")`` resolves the residual next to it, exactly as for a file
or an S3 object). How they answer is :mod:`lynxkv.serve.server`'s and :mod:`lynxkv.serve.ranges`'s part.

What is served. Only the cache the user named: the anchor file, the residual its header records (or the
``--residual`` override), and the exact segment its header records (or the ``--exact-file``
override), found under the same rules. All are read once at start-up and checked before the port opens: every
header, index and page CRC, and the residual's and the exact segment's magic and ``cache_id`` (and the exact
segment's shape and dtype) against its anchor, so a header that names ``/etc/passwd`` or another cache's
residual is refused, not served. The exact segment is a resource of its own (``GET /<its location>``), sent
behind the residual; an exact file that the trust rule does not let the server follow (recorded outside the
anchor's directory and not allowed, or not a regular file there) is left out, and the cache is served without it
(``exact_skipped`` says why; a client asking for it gets a clear error), while one that is there but damaged or
another cache's is refused like the residual. A recorded location that is absolute, a URL,
or leaves the anchor's directory is followed only as the storage layer's trust rule allows (named with
``--residual``, or under an ``--allow-location`` prefix); the anchor is then served with its header rewritten
to record a relative name (the pages are unchanged), since a client cannot follow the server's own paths. The bytes are served from memory,
so what goes out is what was checked; files that change on disk are read and checked again, under the same rules,
before any of their bytes go out (:mod:`lynxkv.serve.versions`). Each local file is stamped (device, inode, size,
mtime) from the very file descriptor it was read through, and each resource carries a strong ETag (128 bits of the
SHA-256 of the bytes served) and its file's mtime.

DSCP classes. Each resource's packets carry its DSCP class (``IP_TOS`` set on the connection's socket before each
response), which a shaped link (tests/test_stream_netns.py) or a router honours.
"""

from __future__ import annotations

import hashlib
import posixpath
import socket
from dataclasses import dataclass

from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.checksum import crc32
from lynxkv.storage import stamp_of

# DSCP code points (RFC 4594 / 2474); IP_TOS carries DSCP << 2.
DSCP = {"BE": 0, "CS0": 0, "CS1": 8, "AF11": 10, "AF12": 12, "AF13": 14, "CS2": 16, "AF21": 18, "AF22": 20,
        "AF23": 22, "CS3": 24, "AF31": 26, "AF32": 28, "AF33": 30, "CS4": 32, "AF41": 34, "AF42": 36,
        "AF43": 38, "CS5": 40, "EF": 46, "CS6": 48, "CS7": 56}


def parse_dscp(value: str | int | None) -> int | None:
    """``"EF"`` -> 46, ``"cs1"`` -> 8, ``"10"`` -> 10; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, int) or str(value).isdigit():
        v = int(value)
    else:
        key = str(value).upper()
        if key not in DSCP:
            raise InputError(f"DSCP class {value!r}: expected a number 0-63 or one of {', '.join(DSCP)}")
        v = DSCP[key]
    if not 0 <= v <= 63:
        raise InputError(f"DSCP {value!r}: expected 0-63")
    return v


def set_dscp(sock, dscp: int) -> int:
    """Mark ``sock``'s packets with ``dscp``; return the TOS byte the kernel reports back."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


# ---------------------------------------------------------------------------------------------------- the cache


@dataclass(frozen=True)
class Resource:
    name: str  # "anchor", "residual" or "exact"
    path: str  # URL path, without the leading "/"
    data: bytes
    crc32: int
    etag: str = ""  # strong entity tag: a digest of ``data``, so it changes whenever the bytes served do
    modified: int | None = None  # its file's mtime, whole seconds (None, no date: a URL, a rewritten anchor)


def _resource(name: str, path: str, data: bytes, stamp: tuple | None) -> Resource:
    etag = '"' + hashlib.sha256(data).hexdigest()[:32] + '"'  # 128 bits: two versions never share one
    return Resource(name, path, data, crc32(data), etag, None if stamp is None else stamp[3] // 1_000_000_000)


@dataclass(frozen=True)
class ServedCache:
    anchor: Resource
    residual: Resource | None  # None for a single-file cache (its residual is inside the anchor file)
    relocated: bool  # the anchor header was rewritten to record a side segment's served path
    exact: Resource | None = None  # 1.4: an external exact segment (None: none, inline, or not served)
    exact_skipped: str | None = None  # why an exact file the anchor records is not served (the trust rule)
    stamps: tuple = ()  # ((path or URL, stamp_of() when read), ...) of every file read, anchor first
    origin: tuple = ()  # load_served_cache's arguments: (cache, residual, exact, allow)

    def resources(self) -> tuple[Resource, ...]:
        return tuple(r for r in (self.anchor, self.residual, self.exact) if r is not None)

    def on_disk(self) -> bool:
        """Whether the files it was read from are still there unchanged (True for a URL, never looked at again)."""
        return all(stamp is None or stamp_of(url) == stamp for url, stamp in self.stamps)

    def reload(self) -> "ServedCache":
        """The cache read and checked again from the same names, under the same rules (a LynxError if the files
        now there are not whole, or not each other's)."""
        cache, residual, exact, allow = self.origin
        return load_served_cache(cache, residual, exact=exact, allow=allow)


def _safe_relative(location: str) -> bool:
    """A relative location that stays below the anchor's directory (``x.lynxr``, ``cold/x.lynxr``)."""
    if not location or "://" in location or location.startswith(("/", "\\")) or "\\" in location:
        return False
    norm = posixpath.normpath(location)
    return not (norm == "." or norm.startswith("../") or norm == "..") and norm == location


def check_crcs(anchor: bytes, residual: bytes | None, exact: bytes | None = None) -> None:
    """Every header, index and page CRC of the cache, and the side segments' magic and ``cache_id`` against the
    anchor's (the page reader's checks, without decoding the records: a server only moves bytes)."""
    from lynxkv.stream.tier import check_cache_bytes

    check_cache_bytes(anchor, residual, exact, decode=False)


def _served_name(location: str, taken: set[str], default: str) -> tuple[str, bool]:
    """The URL path a side segment recorded as ``location`` is served at, and whether the anchor must be rewritten
    to record it: its own relative location when that is safe and free, else ``default`` next to the anchor."""
    if _safe_relative(location) and location not in taken:
        return location, False
    return default, True


def load_served_cache(cache: str, residual: str | None = None, *, exact: str | None = None,
                      allow=()) -> ServedCache:
    """Read and check the cache the user named (see the module docstring); raise a LynxError if it is not
    whole, or if a side segment is not its own. The residual is the one ``residual`` names, or the location the
    anchor records, followed under the storage layer's trust rule (``allow``: the allow-list); the exact segment
    likewise, ``exact`` or its recorded location, when the anchor names one."""
    from lynxkv.storage import local_path, read_stamped, resolve_location
    from lynxkv.stream.tier import anchor_header_of, relocate_segments

    anchor, anchor_stamp = read_stamped(cache)
    h = anchor_header_of(anchor)
    name = posixpath.basename(local_path(cache).rstrip("/")) or "cache.lynx"
    stem = name[:-len(".lynx")] if name.endswith(".lynx") else name
    taken = {name}
    data: dict[int, bytes | None] = {c.SEGMENT_RESIDUAL: None, c.SEGMENT_EXACT: None}
    sources: dict[int, str] = {}  # where each side segment was read from
    stamps: dict[int, tuple | None] = {}  # and the stamp of the file it was read from
    paths: dict[int, str] = {}
    moves: dict[int, str] = {}
    skipped = None
    for kind, what, override, suffix in ((c.SEGMENT_RESIDUAL, "residual", residual, c.RESIDUAL_SUFFIX),
                                         (c.SEGMENT_EXACT, "exact", exact, c.EXACT_SUFFIX)):
        seg = h.segment(kind)
        if seg is None or seg.placement != c.PLACEMENT_EXTERNAL:
            if override is not None and kind == c.SEGMENT_EXACT:
                raise InputError(f"{cache}: --exact-file: this cache has no exact segment of its own file to serve")
            continue
        try:
            where = override or resolve_location(cache, seg.location, allow=allow, what=what)
        except InputError as exc:
            if kind != c.SEGMENT_EXACT:
                raise
            skipped = str(exc)  # the exact tier is optional: served without it (the message names --exact-file)
            continue
        data[kind], stamps[kind] = read_stamped(where)
        sources[kind] = where
        path, rewrite = _served_name(seg.location, taken, stem + suffix)
        if path in taken:  # the default name is taken too (a hostile header): one more letter
            path, rewrite = stem + suffix + "-" + what, True
        paths[kind] = path
        taken.add(path)
        if rewrite:  # served next to the anchor: a client cannot follow the server's own paths
            moves[kind] = path
    if moves:
        anchor = relocate_segments(anchor, moves)
    try:
        check_crcs(anchor, data[c.SEGMENT_RESIDUAL], data[c.SEGMENT_EXACT])
    except LynxError as exc:
        raise LynxError(f"{cache}: refusing to serve a cache that does not verify: {exc}") from None
    res, ex = ((_resource(what, paths[kind], data[kind], stamps[kind]) if data[kind] is not None else None)
               for kind, what in ((c.SEGMENT_RESIDUAL, "residual"), (c.SEGMENT_EXACT, "exact")))
    # A rewritten anchor's bytes are the server's, not its file's: its file's date would not tell them apart.
    return ServedCache(_resource("anchor", name, anchor, None if moves else anchor_stamp), res, bool(moves), ex,
                       skipped,
                       ((cache, anchor_stamp), *((sources[k], stamps[k]) for k in sources)),
                       (cache, residual, exact, tuple(allow)))
