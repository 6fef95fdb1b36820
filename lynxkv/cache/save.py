"""Writing a cache: :func:`save_cache` (anchor, residual and exact segment, atomically; a replaced cache is the old one
or the new one, whole), :func:`save_cache_layers` (the same from a stream of layers, a few in memory at a time),
:func:`save_dump` (a safetensors KV dump, streamed), and the side files' naming."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
from collections.abc import Iterable, Sequence

from lynxkv.cache.encoded import EncodedCache, lazy_encoding, streamed_encoding
from lynxkv.cache.opened import CacheInfo, default_window, open_cache
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.writer import Parts, write_files
from lynxkv.quant.scheme import DEFAULT, Scheme
from lynxkv.cache.replace import fresh_residual_name, names_residual, settle_dead_writers
from lynxkv.storage import (AtomicWriter, SpillFile, exists, has_protocol, is_local, local_path, record_location,
                            remove, resolve_location, same_object, writer_lock)


def default_residual_path(anchor_path: str | os.PathLike, suffix: str = c.RESIDUAL_SUFFIX) -> str:
    """``x.lynx`` -> ``x.lynxr``; any other name gets ``.lynxr`` appended (``suffix``: ``.lynxe`` for the exact
    segment's file)."""
    p = pathlib.Path(anchor_path)
    return str(p.with_suffix(suffix) if p.suffix == ".lynx" else p.with_name(p.name + suffix))


def default_exact_path(anchor_path: str | os.PathLike) -> str:
    """``x.lynx`` -> ``x.lynxe``: where the exact segment goes by default."""
    return default_residual_path(anchor_path, c.EXACT_SUFFIX)


def save_cache(path: str | os.PathLike, kv_or_encoded, scheme: Scheme = DEFAULT, *,
               residual_path: str | os.PathLike | None = None, residual_location: str | None = None,
               single_file: bool = False, zstd: bool = False, prompt_token_ids: Sequence[int] | None = None,
               model_fingerprint: str | None = None, names: Sequence[str] | None = None,
               cache_id: bytes | None = None, properties: dict[str, str] | None = None, exact: bool = False,
               exact_path: str | os.PathLike | None = None) -> CacheInfo:
    """Encode (unless given an :class:`EncodedCache`) and write a cache atomically; return its info.

    Two files by default: ``path`` (anchor) and ``residual_path`` (default: ``path`` with suffix ``.lynxr``),
    the residual written first so that an anchor file never points at a missing residual. The anchor header
    records the residual as ``residual_location`` (default: its path relative to the anchor's directory; pass a
    URL when the residual will be served from elsewhere). ``properties`` are text key/value pairs recorded in
    the header (the model's name as ``lynxkv.model``, an input file's own metadata).

    ``exact`` adds the exact segment, with which a reader rebuilds the input tensors bit for bit: in
    its own file ``exact_path`` (default ``path`` with suffix ``.lynxe``, written before the anchor), or inline at
    the end of a single file. It needs the original tensors (KV pairs, not an :class:`EncodedCache` without them).

    Replacing a two-file cache is atomic for readers: if the residual path is taken, the new residual goes to a
    fresh name (``x.<id>.lynxr``), and so does the exact file (``x.<id>.lynxe``); the anchor is renamed over the
    old one last, and only then are the old residual and exact files removed; a crash at any point leaves the old
    cache or the new one, each complete (never an anchor naming a missing or an old exact file). Writers of one
    path take turns (:func:`lynxkv.storage.writer_lock`), so two at once leave one whole cache, never a mix, and
    each first removes what a killed one left (:mod:`lynxkv.cache.replace`).
    """
    if isinstance(kv_or_encoded, EncodedCache):
        enc = kv_or_encoded
        if prompt_token_ids is not None:
            enc.prompt_token_ids = list(prompt_token_ids)
        if model_fingerprint is not None:
            enc.model_fingerprint = model_fingerprint
        if names is not None:
            enc.names = tuple(names)
    else:  # each layer quantized as the writer reaches it, its codes packed as the records store them
        enc = lazy_encoding(kv_or_encoded, scheme, prompt_token_ids, model_fingerprint, names, packed=True)
    if properties is not None:
        enc.properties = dict(properties)
    return _save_encoded(path, enc, exact or exact_path is not None, residual_path=residual_path,
                         residual_location=residual_location, single_file=single_file, zstd=zstd, cache_id=cache_id,
                         exact_path=exact_path)


def save_cache_layers(path: str | os.PathLike, layers: Iterable, scheme: Scheme = DEFAULT, *,
                      count: int | None = None, residual_path: str | os.PathLike | None = None,
                      residual_location: str | None = None, single_file: bool = False, zstd: bool = False,
                      prompt_token_ids: Sequence[int] | None = None, model_fingerprint: str | None = None,
                      names: Sequence[str] | None = None, cache_id: bytes | None = None,
                      properties: dict[str, str] | None = None, exact: bool = False,
                      exact_path: str | os.PathLike | None = None,
                      window: int | None = None) -> CacheInfo:
    """:func:`save_cache` for a cache given one layer at a time: ``layers`` yields each layer's ``(keys,
    values)`` (``[H, T, D]`` or ``[1, H, T, D]``, every layer the shape and dtype of the first), and each is
    quantized and its pages written before the next one is taken, so memory holds about ``window`` layers
    (default :func:`lynxkv.cache.default_window`; quantized by as many CPU workers at most), not the cache. ``count``: the number of layers
    (the header, written first, says it), needed unless ``layers`` has a length; a stream that yields another
    number of layers fails and leaves nothing. The bytes written are those :func:`save_cache` writes for the same
    layers; the other options are its own."""
    if count is None:
        if not hasattr(layers, "__len__"):
            raise InputError("count: the number of layers is needed up front for an iterator of layers")
        count = len(layers)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InputError(f"window: expected a number of layers of at least 1, got {window!r}")
    exact = exact or exact_path is not None
    enc = streamed_encoding(layers, count, scheme, prompt_token_ids, model_fingerprint, names, keep_originals=exact,
                            window=window or default_window())
    if properties is not None:
        enc.properties = dict(properties)
    return _save_encoded(path, enc, exact, residual_path=residual_path, residual_location=residual_location,
                         single_file=single_file, zstd=zstd, cache_id=cache_id, exact_path=exact_path)


def _save_encoded(path, enc, exact: bool, *, residual_path, residual_location, single_file: bool, zstd: bool,
                  cache_id, exact_path) -> CacheInfo:
    """The files of an encoded cache (whose layers may be quantized as they are read), under the writer lock."""
    if exact and enc.originals is None:
        raise InputError("exact: an exact segment needs the original tensors; pass the KV pairs, not an "
                         "EncodedCache")
    exact_kv = enc.originals if exact else None
    path = os.fspath(path)
    with writer_lock(path) as lock:  # one writer of this cache at a time: none removes what another is writing
        settle_dead_writers(lock, path)
        rpath, epath = _write_cache(lock, path, enc, residual_path, residual_location, single_file, zstd, cache_id,
                                    exact_kv, exact_path)
        with open_cache(path, residual=rpath, exact=epath) as cache:
            return cache.info


def _write_cache(lock, path: str, enc, residual_path, residual_location, single_file: bool, zstd: bool,
                 cache_id, exact_kv, exact_path) -> tuple[str | None, str | None]:
    """The files of :func:`save_cache`, under its writer lock ``lock`` (each noted in it before it is created or
    removed); return the residual's and the exact file's paths (None: single file, or no exact segment)."""
    exact = exact_kv is not None
    if single_file:
        if residual_path is not None:
            raise InputError("residual_path: a single-file cache keeps its residual inside the anchor file")
        if exact_path is not None:
            raise InputError("exact_path: a single-file cache keeps its exact segment inside the anchor file")
        old = _side_files_of(path)
        for f in old:
            lock.note("old", f)
        # the inline residual and exact sections wait on disk beside the output until the anchor pages are written
        scratch = (lambda: SpillFile(os.path.dirname(os.path.abspath(local_path(path))))) if is_local(path) else Parts
        with AtomicWriter(path) as anchor:
            write_files(enc, anchor, cache_id=cache_id, zstd=zstd, exact_kv=exact_kv,
                        scratch=scratch)
        for stale in old:
            with contextlib.suppress(LynxError):  # the replaced two-file cache's residual and exact, unreferenced
                remove(stale)
        return None, None
    rpath = os.fspath(residual_path) if residual_path is not None else default_residual_path(path)
    if same_object(rpath, path):
        raise InputError(f"{path}: the residual path must differ from the anchor path")
    cache_id = secrets.token_bytes(16) if cache_id is None else bytes(cache_id)
    old = _side_files_of(path)
    if residual_location is None and exists(rpath):
        # Replacing a two-file cache: the new residual goes under a fresh name, so that the anchor now in
        # place keeps its own residual until the new anchor replaces it (a reader sees old or new, never a mix).
        rpath = fresh_residual_name(rpath, cache_id)
    location = residual_location or record_location(path, rpath)
    epath = (os.fspath(exact_path) if exact_path is not None else default_exact_path(path)) if exact else None
    if epath is not None and (same_object(epath, path) or same_object(epath, rpath)):
        raise InputError(f"{epath}: the exact segment's path must differ from the anchor's and the residual's")
    if epath is not None and exists(epath):  # the same for the exact file: the old anchor keeps its own
        epath = fresh_residual_name(epath, cache_id, c.EXACT_SUFFIX)
    created = residual_location is None and not has_protocol(rpath) and not exists(rpath)
    lock.note("new" if created else "tmp", rpath)  # a residual recorded elsewhere is the caller's to keep
    exact_created = epath is not None and not has_protocol(epath) and not exists(epath)
    if epath is not None:
        lock.note("new" if exact_created else "tmp", epath)
    for f in old:
        if not same_object(f, rpath) and not (epath is not None and same_object(f, epath)):
            lock.note("old", f)
    residual, anchor, exact_w, published = AtomicWriter(rpath), None, None, []
    try:
        exact_w = AtomicWriter(epath) if epath is not None else None
        anchor = AtomicWriter(path)
        write_files(enc, anchor, residual, cache_id=cache_id, zstd=zstd, residual_location=location,
                    exact_kv=exact_kv, exact=exact_w,
                    exact_location=record_location(path, epath) if epath is not None else "")
        residual.commit()  # first: an anchor never points at a missing residual
        if created:
            published.append(rpath)
        if exact_w is not None:
            exact_w.commit()
            if exact_created:
                published.append(epath)
        anchor.commit()
    except BaseException:
        for w in (residual, exact_w, anchor):
            if w is not None:
                w.abort()
        for f in published:  # the anchor failed (a full disk): what this writer published, no anchor names
            if names_residual(path, f) is False:
                with contextlib.suppress(LynxError):
                    remove(f)
        raise
    for stale in old:
        if not same_object(stale, rpath) and not (epath is not None and same_object(stale, epath)):
            with contextlib.suppress(LynxError):  # the old cache's residual and exact file, now unreferenced
                remove(stale)
    return rpath, epath


def residual_file_of(path: str) -> str | None:
    """The residual file of the two-file cache now at ``path``, if there is one a writer replacing the cache may
    delete afterwards: its recorded location is inside the anchor's directory (the trust rule), a local file."""
    return _recorded_file_of(path, "residual_location")


def exact_file_of(path: str) -> str | None:
    """The exact file of the cache now at ``path``, on the terms of :func:`residual_file_of`."""
    return _recorded_file_of(path, "exact_location")


def _recorded_file_of(path: str, field: str) -> str | None:
    if has_protocol(path) or not os.path.isfile(path):
        return None
    try:
        with open_cache(path) as old:
            loc = getattr(old.info, field)
            return None if loc is None else resolve_location(old.name, loc)
    except LynxError:
        return None


def _side_files_of(path: str) -> list[str]:
    """The residual and exact files of the cache now at ``path`` that a writer replacing it may delete afterwards."""
    return [f for f in (residual_file_of(path), exact_file_of(path)) if f is not None]


def save_dump(dump_path, path: str | os.PathLike, scheme: Scheme = DEFAULT, *, memory: int | None = None,
              residual_path: str | os.PathLike | None = None, residual_location: str | None = None,
              single_file: bool = False, zstd: bool = False, prompt_token_ids: Sequence[int] | None = None,
              model_fingerprint: str | None = None, cache_id: bytes | None = None,
              properties: dict[str, str] | None = None, exact: bool = False,
              exact_path: str | os.PathLike | None = None) -> CacheInfo:
    """Encode a safetensors KV dump (:mod:`lynxkv.cache.dumps`) into a cache, keeping its tensor names and shapes
    (and its metadata, under ``properties``); the other options are :func:`save_cache`'s. The dump's header is
    checked first; then each layer is read, quantized and written in pieces of whole pages
    (:meth:`lynxkv.cache.dumps.KVDump.iter_pieces`), a piece's pages written before the next piece is read, so
    that memory holds about ``memory`` bytes of pieces (:func:`lynxkv.cache.encoded.piece_plan`; default
    :data:`lynxkv.cache.budget.DEFAULT_ENCODE_MEMORY`), not a layer; a bound below one page is refused before
    anything is read. The bytes written are those :func:`save_cache` writes for the same tensors."""
    from lynxkv.cache.budget import DEFAULT_ENCODE_MEMORY
    from lynxkv.cache.dumps import open_dump
    from lynxkv.cache.encoded import piece_plan, pieced_encoding

    dump = open_dump(dump_path)
    h, t, d = dump.shape
    piece_tokens, workers = piece_plan(DEFAULT_ENCODE_MEMORY if memory is None else memory, h, t, d, dump.dtype,
                                       scheme.page)
    exact = exact or exact_path is not None
    enc = pieced_encoding(dump.iter_pieces(piece_tokens), dump.layers, dump.shape, dump.dtype, scheme,
                          piece_tokens=piece_tokens, workers=workers, batched=dump.naming.batched,
                          prompt_token_ids=prompt_token_ids, model_fingerprint=model_fingerprint,
                          names=dump.tensor_names, keep_originals=exact)
    enc.properties = {**dict(dump.naming.metadata), **(properties or {})} or None  # the file's own metadata
    return _save_encoded(path, enc, exact, residual_path=residual_path, residual_location=residual_location,
                         single_file=single_file, zstd=zstd, cache_id=cache_id, exact_path=exact_path)
