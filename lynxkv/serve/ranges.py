"""Which bytes a ``GET`` or ``HEAD`` of a served resource answers with (RFC 9110 sections 13.1.5 and 14).

- ``Range: bytes=a-b``, ``bytes=a-``, ``bytes=-n``: one range, ``206 Partial Content`` with ``Content-Range``.
- More than one range (``bytes=0-9,20-29``): the ``Range`` header is ignored and the whole resource is sent with
  ``200`` (RFC 9110 lets a server ignore ``Range``; ``multipart/byteranges`` is not served). The header is never
  split into ranges, so a request naming hundreds costs no more than a plain ``GET``.
- A range unit other than ``bytes``: ignored (``200``), as RFC 9110 requires.
- A malformed byte range (``bytes=9-1``, ``bytes=x``): ``400``. An unsatisfiable one (starting at or past the end,
  ``bytes=-0``, any range of an empty resource): ``416`` with ``Content-Range: bytes */<size>``.
- ``If-Range`` (only with ``Range``): a strong entity tag equal to the resource's ``ETag``, or an HTTP-date equal
  to its ``Last-Modified`` while that date is a strong validator, selects the range; anything else (another tag,
  a weak ``W/`` tag, another date, something unparsable) sends the whole resource with ``200``, so a client
  resuming from an older version never gets a splice of two. The ``Range`` header is then not even parsed.
"""

from __future__ import annotations

import email.utils
import re

_RANGE = re.compile(r"(\d*)-(\d*)")
_MAX_SPEC = 64  # characters of one byte range: two 20-digit numbers and then some


class HTTPRefusal(Exception):
    """A request answered with a 4xx: ``status``, a one-line message and the headers that go with it."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


def _unsatisfiable(message: str, size: int) -> HTTPRefusal:
    return HTTPRefusal(416, message, {"Content-Range": f"bytes */{size}"})


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``[start, end)`` of a single-range ``Range`` header; None: send the whole resource (no header, several
    ranges, another unit). Raises :class:`HTTPRefusal` (400 or 416) as the module docstring says."""
    if header is None:
        return None
    unit, eq, spec = header.partition("=")
    if not eq or not unit.strip():
        raise HTTPRefusal(400, "malformed Range header: expected bytes=START-END, bytes=START- or bytes=-N")
    if unit.strip().lower() != "bytes":
        return None
    if "," in spec:  # a list; empty elements do not count (RFC 9110 section 5.6.1)
        specs = [s for s in (p.strip() for p in spec.split(",")) if s]  # the header is at most 8 KiB (aiohttp)
        if len(specs) > 1:
            return None
        spec = specs[0] if specs else ""
    spec = spec.strip()
    m = _RANGE.fullmatch(spec) if len(spec) <= _MAX_SPEC else None
    if not m or not (m.group(1) or m.group(2)):
        raise HTTPRefusal(400, "malformed Range header: expected bytes=START-END, bytes=START- or bytes=-N")
    a, b = m.group(1), m.group(2)
    if a and b and int(b) < int(a):
        raise HTTPRefusal(400, f"malformed Range header: end {b} before start {a}")
    if not a:  # the last N bytes
        if int(b) == 0 or size == 0:
            raise _unsatisfiable("empty suffix range" if size else "the resource is empty", size)
        return max(0, size - int(b)), size
    start = int(a)
    if start >= size:
        raise _unsatisfiable(f"range starts at {start}, the resource has {size} bytes", size)
    return start, min(int(b) + 1, size) if b else size


def http_date(seconds: int) -> str:
    """``Sun, 06 Nov 1994 08:49:37 GMT`` (IMF-fixdate)."""
    return email.utils.formatdate(seconds, usegmt=True)


def if_range_holds(value: str, *, etag: str, modified: int | None, date_is_strong: bool) -> bool:
    """Whether an ``If-Range`` value names the representation that would be served (RFC 9110 section 13.1.5):
    ``etag`` compared strongly, or ``modified`` (Last-Modified, seconds) when ``date_is_strong``."""
    value = value.strip()
    if value.startswith('"'):
        return value == etag
    if value.startswith("W/") or modified is None or not date_is_strong or len(value) > 64:
        return False
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return False
    return when.tzinfo is not None and int(when.timestamp()) == modified


def select(range_header: str | None, if_range: str | None, size: int, *, etag: str, modified: int | None,
           date_is_strong: bool) -> tuple[int, int, int]:
    """``(status, start, end)`` of the answer to a request with these ``Range`` and ``If-Range`` headers: 206 with
    the range, or 200 with the whole resource; raises :class:`HTTPRefusal` for a bad or unsatisfiable range."""
    if range_header is None:
        return 200, 0, size
    if if_range is not None and not if_range_holds(if_range, etag=etag, modified=modified,
                                                     date_is_strong=date_is_strong):
        return 200, 0, size
    rng = parse_range(range_header, size)
    return (200, 0, size) if rng is None else (206, *rng)
