"""Where a segment lives, and whether a reader may go there: the trust rule (spec/FORMAT.md §7.1)."""

from __future__ import annotations

import os
import posixpath

from lynxkv.errors import InputError
from lynxkv.storage.urls import has_protocol, is_local, local_path, protocol_of


ALLOW_ENV = "LYNXKV_ALLOW_LOCATIONS"


def _normal(url: str) -> str:
    """A location in one spelling, for prefix checks: local paths absolute with symlinks resolved, URLs with a
    lower-case scheme and ``.``/``..``/``//`` folded."""
    if is_local(url):
        return os.path.realpath(local_path(url))
    proto, rest = url.split("://", 1)
    norm = posixpath.normpath(rest) if rest else ""
    if rest.endswith("/") and not norm.endswith("/"):
        norm += "/"
    return f"{proto.lower()}://{norm}"


def allowed_locations(allow=()) -> tuple[str, ...]:
    """The allow-list: ``allow`` plus the comma-separated prefixes in ``$LYNXKV_ALLOW_LOCATIONS``."""
    env = [p.strip() for p in os.environ.get(ALLOW_ENV, "").split(",") if p.strip()]
    return tuple(str(a) for a in allow) + tuple(env)


def _under(target: str, prefix: str) -> bool:
    """``target`` is ``prefix`` or lies below it (``s3://b/x`` is not below ``s3://b/x-other``)."""
    if target == prefix:
        return True
    return target.startswith(prefix if prefix.endswith("/") else prefix + "/")


def _is_allowed(target: str, allow) -> bool:
    t = _normal(target)
    return any(_under(t, _normal(p)) for p in allowed_locations(allow))


def _regular_file(path: str, what: str) -> None:
    import stat

    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InputError(f"{what} {path}: no such file or object (it does not exist)") from None
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot stat ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path} is not a regular file; refusing to read it")


def _option(what: str, *, out: bool = False) -> str:
    """The command-line option that names the segment ``what`` explicitly (``out``: where its copy goes)."""
    if what.startswith("exact"):
        return "--exact-out" if out else "--exact-file"
    return "--residual-out" if out else "--residual"


def _check_characters(location: str, what: str) -> None:
    """A recorded location is a path or URL: no control characters (a NUL that the OS cannot take, a newline or
    terminal escape that would forge lines of output)."""
    if any(ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 for ch in location):
        raise InputError(f"the anchor records its {what} at {location!r}, which contains control characters; "
                         f"pass {_option(what)} to name the {what} explicitly")


def _beside(anchor: str, location: str) -> tuple[str, str, bool]:
    """``location`` joined to the directory of ``anchor`` and normalised, that directory (a URL's ends in ``/``),
    and whether the two are remote (a URL) rather than local paths."""
    if has_protocol(anchor) and not is_local(anchor):
        proto, rest = anchor.split("://", 1)
        base = posixpath.dirname(rest)
        return f"{proto}://{posixpath.normpath(posixpath.join(base, location))}", f"{proto}://{base}/", True
    base = os.path.dirname(os.path.abspath(local_path(anchor)))
    return os.path.normpath(os.path.join(base, location)), base, False


def resolve_location(anchor: str | None, location: str, *, allow=(), what: str = "residual") -> str:
    """Where a segment recorded as ``location`` in the anchor at ``anchor`` (a path or URL; ``None`` or a
    ``<...>`` name when the anchor came from memory) lives -- and whether the reader may go there.

    The trust rule (spec/FORMAT.md, "Locations"): a file names only places the user named or allowed.

    - A relative location is taken relative to the anchor's directory (``x.lynxr`` next to
      ``s3://b/dir/x.lynx`` is ``s3://b/dir/x.lynxr``) and must stay inside it after normalisation; a local one
      must also stay inside after resolving symbolic links, and be a regular file (no FIFO, no device).
    - An absolute path or a URL, or a relative location that leaves the anchor's directory, is followed only
      when it lies under a prefix of the allow-list (``allow``, e.g. ``--allow-location s3://bucket/``, plus
      ``$LYNXKV_ALLOW_LOCATIONS``), compared after normalisation.

    Anything else is an InputError that names the location and how to allow it (``--residual`` names the
    segment explicitly and bypasses this function)."""
    hint = (f"pass {_option(what)} to name the {what} explicitly, or allow its place with --allow-location PREFIX "
            f"(or ${ALLOW_ENV})")
    _check_characters(location, what)
    if has_protocol(location) or location.startswith("/"):
        if _is_allowed(location, allow):
            return location
        raise InputError(f"the anchor records its {what} at {location!r}, outside the anchor's directory; {hint}")
    if anchor is None or anchor.startswith("<"):
        raise InputError(f"the anchor records its {what} at the relative location {location!r}, but the anchor "
                         f"was not read from a file; pass the {what} explicitly")
    target, base, remote = _beside(anchor, location)
    if remote:
        inside = _under(_normal(target), _normal(base))
    else:
        inside = _under(target, base) and _under(os.path.realpath(target), os.path.realpath(base))
    if not inside and not _is_allowed(target, allow):
        raise InputError(f"the anchor records its {what} at {location!r}, which leads outside the anchor's "
                         f"directory; {hint}")
    if is_local(target):
        _regular_file(target, what)
    return target


def write_target(dest_anchor: str, location: str, *, what: str = "residual") -> str:
    """Where to write a copy of a segment recorded as ``location`` next to the anchor copy ``dest_anchor``: a
    relative location that stays inside the destination's directory (and is not a symbolic link)."""
    _check_characters(location, what)
    if has_protocol(location) or location.startswith("/"):
        raise InputError(f"the anchor records its {what} at the absolute location {location}; say where to write "
                         f"the copy with {_option(what, out=True)}")
    target, base, remote = _beside(dest_anchor, location)
    if remote:
        inside = _under(_normal(target), _normal(base))
    else:
        inside = _under(target, base) and not os.path.islink(target)
    if not inside:
        raise InputError(f"the anchor records its {what} at {location!r}, which leads outside the directory of "
                         f"{dest_anchor}; say where to write the copy with {_option(what, out=True)}")
    return target


def _canonical(url: str) -> str:
    return os.path.abspath(local_path(url)) if is_local(url) else url


def same_object(a: str, b: str) -> bool:
    return _canonical(a) == _canonical(b)


def record_location(anchor: str, segment: str) -> str:
    """How the anchor at ``anchor`` should record a segment at ``segment``: a relative path when both live in the
    same place (same local disk, same bucket or host), otherwise the absolute path or URL."""
    if is_local(anchor) and is_local(segment):
        return posixpath.join(*os.path.relpath(_canonical(segment), os.path.dirname(_canonical(anchor))).split(os.sep))
    if has_protocol(anchor) and has_protocol(segment) and protocol_of(anchor) == protocol_of(segment):
        a, r = anchor.split("://", 1)[1], segment.split("://", 1)[1]
        if a.split("/", 1)[0] == r.split("/", 1)[0]:  # same bucket / host
            return posixpath.relpath(r, posixpath.dirname(a))
    return _canonical(segment)
