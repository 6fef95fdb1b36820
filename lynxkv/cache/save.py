"""Writing a cache: :func:`save_cache` (anchor and residual, atomically; a replaced cache is the old one or the new
one, whole), :func:`save_dump` (a safetensors KV dump), and the residual's file naming."""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
from collections.abc import Sequence

from lynxkv.cache.encoded import EncodedCache, lazy_encoding
from lynxkv.cache.opened import CacheInfo, open_cache
from lynxkv.errors import InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.format.writer import write_files
from lynxkv.quant.scheme import DEFAULT, Scheme
from lynxkv.cache.replace import fresh_residual_name, names_residual, settle_dead_writers
from lynxkv.storage import (AtomicWriter, exists, has_protocol, record_location, remove, resolve_location,
                            same_object, writer_lock)


def default_residual_path(anchor_path: str | os.PathLike) -> str:
    """``x.lynx`` -> ``x.lynxr``; any other name gets ``.lynxr`` appended."""
    p = pathlib.Path(anchor_path)
    return str(p.with_suffix(c.RESIDUAL_SUFFIX) if p.suffix == ".lynx" else p.with_name(p.name + c.RESIDUAL_SUFFIX))


def save_cache(path: str | os.PathLike, kv_or_encoded, scheme: Scheme = DEFAULT, *,
               residual_path: str | os.PathLike | None = None, residual_location: str | None = None,
               single_file: bool = False, zstd: bool = False, prompt_token_ids: Sequence[int] | None = None,
               model_fingerprint: str | None = None, names: Sequence[str] | None = None,
               cache_id: bytes | None = None, properties: dict[str, str] | None = None) -> CacheInfo:
    """Encode (unless given an :class:`EncodedCache`) and write a cache atomically; return its info.

    Two files by default: ``path`` (anchor) and ``residual_path`` (default: ``path`` with suffix ``.lynxr``),
    the residual written first so that an anchor file never points at a missing residual. The anchor header
    records the residual as ``residual_location`` (default: its path relative to the anchor's directory; pass a
    URL when the residual will be served from elsewhere). ``properties`` are text key/value pairs recorded in
    the header (the model's name as ``lynxkv.model``, an input file's own metadata).

    Replacing a two-file cache is atomic for readers: if the residual path is taken, the new residual goes to a
    fresh name (``x.<id>.lynxr``), the anchor is renamed over the old one last, and only then is the old
    residual removed; a crash at any point leaves the old cache or the new one, each complete. Writers of one
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
    path = os.fspath(path)
    with writer_lock(path) as lock:  # one writer of this cache at a time: none removes what another is writing
        settle_dead_writers(lock, path)
        rpath = _write_cache(lock, path, enc, residual_path, residual_location, single_file, zstd, cache_id)
        with open_cache(path, residual=rpath) as cache:
            return cache.info


def _write_cache(lock, path: str, enc, residual_path, residual_location, single_file: bool, zstd: bool,
                 cache_id) -> str | None:
    """The files of :func:`save_cache`, under its writer lock ``lock`` (each noted in it before it is created or
    removed); return the residual's path (None: single file)."""
    if single_file:
        if residual_path is not None:
            raise InputError("residual_path: a single-file cache keeps its residual inside the anchor file")
        old = residual_file_of(path)
        if old is not None:
            lock.note("old", old)
        with AtomicWriter(path) as anchor:
            write_files(enc, anchor, cache_id=cache_id, zstd=zstd)
        if old is not None:
            with contextlib.suppress(LynxError):  # the replaced two-file cache's residual, now unreferenced
                remove(old)
        return None
    rpath = os.fspath(residual_path) if residual_path is not None else default_residual_path(path)
    if same_object(rpath, path):
        raise InputError(f"{path}: the residual path must differ from the anchor path")
    cache_id = secrets.token_bytes(16) if cache_id is None else bytes(cache_id)
    old = residual_file_of(path)
    if residual_location is None and exists(rpath):
        # Replacing a two-file cache: the new residual goes under a fresh name, so that the anchor now in
        # place keeps its own residual until the new anchor replaces it (a reader sees old or new, never a mix).
        rpath = fresh_residual_name(rpath, cache_id)
    location = residual_location or record_location(path, rpath)
    created = residual_location is None and not has_protocol(rpath) and not exists(rpath)
    lock.note("new" if created else "tmp", rpath)  # a residual recorded elsewhere is the caller's to keep
    if old is not None and not same_object(old, rpath):
        lock.note("old", old)
    residual, anchor, published = AtomicWriter(rpath), None, False
    try:
        anchor = AtomicWriter(path)
        write_files(enc, anchor, residual, cache_id=cache_id, zstd=zstd, residual_location=location)
        residual.commit()  # first: an anchor never points at a missing residual
        published = True
        anchor.commit()
    except BaseException:
        for w in (residual, anchor):
            if w is not None:
                w.abort()
        if published and created and names_residual(path, rpath) is False:  # the anchor failed (a full disk)
            with contextlib.suppress(LynxError):
                remove(rpath)
        raise
    if old is not None and not same_object(old, rpath):
        with contextlib.suppress(LynxError):  # the old cache's residual, now unreferenced
            remove(old)
    return rpath


def residual_file_of(path: str) -> str | None:
    """The residual file of the two-file cache now at ``path``, if there is one a writer replacing the cache may
    delete afterwards: its recorded location is inside the anchor's directory (the trust rule), a local file."""
    if has_protocol(path) or not os.path.isfile(path):
        return None
    try:
        with open_cache(path) as old:
            loc = old.info.residual_location
            return None if loc is None else resolve_location(old.name, loc)
    except LynxError:
        return None


def save_dump(dump_path, path: str | os.PathLike, scheme: Scheme = DEFAULT, **options) -> CacheInfo:
    """Encode a safetensors KV dump (:mod:`lynxkv.cache.dumps`) into a cache, keeping its tensor names and shapes;
    ``options`` as for :func:`save_cache`."""
    from lynxkv.cache.dumps import kv_names, load_kv_safetensors

    kv, naming = load_kv_safetensors(dump_path)
    if naming.batched:  # keep the [1, H, T, D] shape so that decoding writes it back the same way
        kv = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv]
    properties = {**dict(naming.metadata), **(options.pop("properties", None) or {})}  # the file's own metadata
    return save_cache(path, kv, scheme, names=kv_names(len(kv), naming), properties=properties or None, **options)
