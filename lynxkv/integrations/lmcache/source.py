"""Progressive reads from an LMCache store with the lynx tier: ``lmcache://MODEL?anchor_path=DIR&tokens=IDS``.

The lynx tier (:mod:`lynxkv.integrations.lmcache.adapter`) keeps each 256-token chunk of a prompt as two objects,
``<anchor_path>/<name>.lynx`` and ``<residual_path>/<name>.lynxr``, named from the chunk's LMCache key
(:func:`object_name`). This transport reads a prompt's stored prefix from those two places: it computes the keys
of the prompt's chunks with LMCache's own key resolver and token hasher (a rolling hash per complete chunk: the
keys ``lmcache server`` gives an engine's request for the same tokens), reads each chunk's headers and page
indexes, joins the chunks into one cache (:mod:`lynxkv.stream.joined`) and streams that: the anchor pages of
every chunk first, then their residual pages, every page checked against the CRC stored with its object.

Why the store, not the server: ``lmcache server`` hands an engine its KV decoded in full, into buffers the engine
registered (shared memory, CUDA IPC); it has no anchor-first path. The lynx tier's objects are plain files or
URLs that any reader can range-read, so the lynx runner drafts on the bytes the engine's store serves.

The URL (query values percent-encoded):

- ``MODEL``: the model name as the engine stores it (vLLM's ``--model``): everything between ``lmcache://`` and ``?``;
- ``anchor_path`` (required): the tier's ``anchor_path``, a directory or URL;
- ``tokens`` (required): the prompt's token ids, comma-separated, or ``@FILE``, a file of ids (a JSON list, or ids
  separated by commas or white space);
- ``residual_path``: the tier's ``residual_path`` (also ``residual=``, ``--residual``); without it each anchor's
  recorded residual location is followed under the trust rule (``allow_locations``, ``--allow-location``);
- ``salt`` (the cache salt), ``world_size`` and ``rank`` (tensor parallelism: which rank's slice), ``group`` (the
  object group), ``chunk_size`` and ``hash`` (the server's ``--chunk-size`` and ``--hash-algorithm``, default 256
  and blake3).

Trust: only the objects of the computed keys are read, under the places the URL names (and residual locations the
user allowed); the model name and the salt are escaped into file names, never paths.

Which chunks: like LMCache, the longest stored prefix of complete chunks. A chunk that is missing, whose headers or
indexes are damaged, whose residual is missing or belongs to another cache, or whose object carries another key's
cache id, ends the prefix there (``timeline.extra["lmcache"]``: ``chunks``, ``miss``); no stored chunk is an
error. A page whose CRC fails while streaming fails the load as for any cache; page ``p`` of layer ``l`` of the
joined cache is page ``p`` of chunk ``p // pages_per_chunk`` (with 256-token pages, chunk ``p``).

Importing this module needs no LMCache: the ``lmcache`` extra (``pip install "lynxkv[lmcache]"``) is imported
when a load starts, and an ``lmcache://`` source without it is one clear error.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import importlib.util
import os
import posixpath
import re
from dataclasses import dataclass
from urllib.parse import unquote

from lynxkv.errors import FormatError, InputError, LynxError
from lynxkv.format import constants as c
from lynxkv.storage import has_protocol, read_all
from lynxkv.stream.buffer import StreamBuffer
from lynxkv.stream.joined import (JoinedCache, JoinedSegment, Part, join_caches, join_problem, joined_cache_id,
                                  read_part)
from lynxkv.stream.link import ANCHOR, RESIDUAL
from lynxkv.stream.transport import StorageTransport, Transfer, register_transport

SCHEME = "lmcache"
EXTRA = 'pip install "lynxkv[lmcache]"'
MODEL_PROPERTY = "lynxkv.model"
_PARAMS = ("anchor_path", "tokens", "residual_path", "salt", "world_size", "rank", "group", "chunk_size", "hash")
_MAX_TOKEN_FILE = 64 << 20


# ------------------------------------------------------------------------------------------ keys and names
def object_name(key) -> str:
    """The file name (without extension) of a chunk in the lynx tier: every key field, the model name first
    (``%`` and ``/`` escaped, so that a name is never a path)."""
    model = key.model_name.replace("%", "%25").replace("/", "%2F")
    name = f"{model}@{key.kv_rank:#010x}@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    return f"{name}@{key.cache_salt}" if key.cache_salt else name


def key_cache_id(key) -> bytes:
    """The cache id the ``lynx`` serde gives a chunk: derived from its key, so an object under another key's name
    is recognised as foreign."""
    parts = (key.model_name, key.kv_rank, key.object_group_id, key.chunk_hash.hex(), key.cache_salt)
    return hashlib.blake2b("\x00".join(map(str, parts)).encode(), digest_size=16).digest()


def name_fingerprint(model_name: str) -> str:
    """The model fingerprint the ``lynx`` serde records in a chunk (32 hex digits). LMCache knows a model by its
    name only, so this is a hash of the name, not of the weights (:func:`lynxkv.hf.models.model_fingerprint`): a
    cache from an LMCache store identifies its model exactly as the store's keys do."""
    return hashlib.blake2b(model_name.encode(), digest_size=16).hexdigest()


def is_lmcache_source(source) -> bool:
    return isinstance(source, str) and source.lower().startswith(SCHEME + "://")


def _join(base: str, name: str) -> str:
    return posixpath.join(base, name) if has_protocol(base) else os.path.join(base, name)


def object_paths(key, anchor_path: str, residual_path: str) -> tuple[str, str]:
    """Where the lynx tier keeps a chunk: ``<anchor_path>/<name>.lynx`` and ``<residual_path>/<name>.lynxr``."""
    name = object_name(key)
    return _join(anchor_path, name + ".lynx"), _join(residual_path, name + ".lynxr")


def exact_object_path(key, exact_path: str) -> str:
    """Where the lynx tier keeps a chunk's exact segment: ``<exact_path>/<name>.lynxe``."""
    return _join(exact_path, object_name(key) + c.EXACT_SUFFIX)


# ------------------------------------------------------------------------------------------ the URL
@dataclass(frozen=True)
class StoreAddress:
    """A parsed ``lmcache://`` URL (see the module docstring)."""

    model: str
    anchor_path: str
    tokens: tuple[int, ...]
    residual_path: str | None = None
    salt: str = ""
    world_size: int = 1
    rank: int = 0
    group: int = 0
    chunk_size: int = 256
    hash_algorithm: str = "blake3"


def _int(name: str, text: str, low: int, high: int) -> int:
    if not re.fullmatch(r"[0-9]{1,10}", text) or not low <= int(text) <= high:
        raise InputError(f"lmcache URL: {name} must be an integer from {low} to {high}, got {text[:40]!r}")
    return int(text)


def _token_ids(text: str) -> tuple[int, ...]:
    if text.startswith("@"):
        data = read_all(text[1:])
        if len(data) > _MAX_TOKEN_FILE:
            raise InputError(f"lmcache URL: the token file {text[1:]} is over {_MAX_TOKEN_FILE >> 20} MiB")
        text = data.decode("utf-8", errors="replace").strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
    items = [t for t in re.split(r"[\s,]+", text) if t]
    if len(items) > c.MAX_TOKENS:
        raise InputError(f"lmcache URL: {len(items)} token ids, at most {c.MAX_TOKENS}")
    bad = next((t for t in items if not re.fullmatch(r"[0-9]{1,10}", t) or int(t) >= 2**32), None)
    if bad is not None:
        raise InputError(f"lmcache URL: token ids must be integers from 0 to 2^32-1, got {bad[:40]!r}")
    return tuple(int(t) for t in items)


def parse_address(url: str) -> StoreAddress:
    """``lmcache://MODEL?anchor_path=...&tokens=...`` -> a :class:`StoreAddress`; anything else is an InputError."""
    prefix = SCHEME + "://"
    if not is_lmcache_source(url):
        raise InputError(f"not an lmcache URL: {url[:80]!r}")
    model_part, _, query = url[len(prefix):].partition("?")
    model = unquote(model_part)
    if not model or "@" in model:
        raise InputError("lmcache URL: expected lmcache://MODEL?anchor_path=...&tokens=... with the model name the "
                         "engine stores KV under (no '@')")
    params: dict[str, str] = {}
    for item in filter(None, query.split("&")):
        name, eq, value = item.partition("=")
        name = unquote(name)
        if name not in _PARAMS or not eq:
            raise InputError(f"lmcache URL: unknown parameter {name[:40]!r} (known: {', '.join(_PARAMS)})")
        if name in params:
            raise InputError(f"lmcache URL: {name} given twice")
        params[name] = unquote(value)
    for need in ("anchor_path", "tokens"):
        if not params.get(need):
            raise InputError(f"lmcache URL: {need}= is required (lmcache://MODEL?anchor_path=DIR&tokens=1,2,...)")
    world_size = _int("world_size", params.get("world_size", "1"), 1, 1 << 16)
    return StoreAddress(
        model=model, anchor_path=params["anchor_path"], tokens=_token_ids(params["tokens"]),
        residual_path=params.get("residual_path") or None, salt=params.get("salt", ""), world_size=world_size,
        rank=_int("rank", params.get("rank", "0"), 0, world_size - 1),
        group=_int("group", params.get("group", "0"), 0, 1 << 16),
        chunk_size=_int("chunk_size", params.get("chunk_size", "256"), 1, 1 << 20),
        hash_algorithm=params.get("hash", "blake3"))


def lmcache_available() -> bool:
    return importlib.util.find_spec("lmcache") is not None


def chunk_keys(addr: StoreAddress) -> list:
    """The LMCache object keys of the complete chunks of ``addr.tokens``, in token order, for this rank and group:
    LMCache's own resolver (``resolve_object_keys``, ``TokenHasher``), as ``lmcache server`` computes them."""
    level = os.environ.get("LMCACHE_LOG_LEVEL")
    if level is None:  # LMCache's loggers take their level when first imported: its INFO lines are noise here
        os.environ["LMCACHE_LOG_LEVEL"] = "WARNING"
    try:
        from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
        from lmcache.v1.multiprocess.token_hasher import TokenHasher
    except ImportError as exc:
        raise InputError(f"lmcache:// sources need LMCache: {EXTRA} ({exc})") from None
    finally:
        if level is None:
            os.environ.pop("LMCACHE_LOG_LEVEL", None)
    try:
        hasher = TokenHasher(chunk_size=addr.chunk_size, hash_algorithm=addr.hash_algorithm)
        keys, _ = resolve_object_keys(hasher, addr.model, addr.world_size, list(addr.tokens), addr.salt)
    except ValueError as exc:
        raise InputError(f"lmcache URL: {exc}") from None
    keys = keys[addr.rank::addr.world_size]  # chunk-major, one key per rank
    return [dataclasses.replace(k, object_group_id=addr.group) for k in keys] if addr.group else keys


# ------------------------------------------------------------------------------------------ the stored prefix
def read_chunk(key, addr: StoreAddress, *, allow=(), storage_options: dict | None = None) -> Part:
    """One chunk's two objects, headers and indexes checked and bound to ``key``; a LynxError says why not."""
    anchor_url, named_residual = object_paths(key, addr.anchor_path, addr.residual_path or addr.anchor_path)
    part = read_part(anchor_url, named_residual if addr.residual_path else None, allow=allow,
                     storage_options=storage_options)
    if part.header.cache_id != key_cache_id(key):
        raise FormatError(f"{anchor_url}: the object carries another chunk's cache id", field="cache_id")
    return part


def stored_prefix(keys: list, addr: StoreAddress, *, allow=(), storage_options: dict | None = None,
                  workers: int = 4) -> tuple[list[Part], str | None]:
    """The parts of the longest stored prefix of ``keys`` (heads read ``workers`` at a time), and why it ends
    before the last key (None when every chunk is there)."""
    parts: list[Part] = []
    with cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="lynxkv-lmcache-head") as pool:
        futures = [pool.submit(read_chunk, k, addr, allow=allow, storage_options=storage_options) for k in keys]
        try:
            for i, (key, fut) in enumerate(zip(keys, futures)):
                try:
                    part = fut.result()
                except LynxError as exc:
                    return parts, f"chunk {i} ({object_name(key)}): {exc}"
                problem = (f"{part.header.tokens} tokens, the chunk size is {addr.chunk_size}"
                           if part.header.tokens != addr.chunk_size else
                           join_problem(parts[-1].header, part.header) if parts else None)
                if problem is not None:
                    return parts, f"chunk {i} ({object_name(key)}): {problem}"
                parts.append(part)
        finally:
            for f in futures:
                f.cancel()
    return parts, None


# ------------------------------------------------------------------------------------------ the transport
class LMCacheTransport(StorageTransport):
    """The :class:`~lynxkv.stream.transport.Transport` of ``lmcache://`` sources (see the module docstring): the
    storage transport's block streams, priority and retries, over the joined cache's segments."""

    def __init__(self, url: str, transfer: Transfer, *, residual: str | None = None, **options):
        addr = parse_address(url)
        if residual is not None and addr.residual_path is not None and residual != addr.residual_path:
            raise InputError("lmcache URL: residual_path= and --residual name two different places")
        if residual is not None:
            addr = dataclasses.replace(addr, residual_path=residual)
        if not lmcache_available():
            raise InputError(f"lmcache:// sources need LMCache, which is not installed: {EXTRA}")
        super().__init__(url, transfer, **options)
        self.address = addr
        self.residual_url = addr.residual_path
        self.joined: JoinedCache | None = None

    def _pump(self, seg: JoinedSegment, stream: int, name: str) -> StreamBuffer:
        t = self.transfer
        buf = t.buffer(seg.size, name)
        t.pump(self._blocks(f"{SCHEME}:{self.address.model} {name}", 0, seg.size, stream, name,
                            fetch=lambda a, b: seg.fetch(a, b, self.storage_options)),
               buf, stream, name, charge_link=False)
        return buf

    def open_anchor(self) -> StreamBuffer:
        addr = self.address
        keys = chunk_keys(addr)
        if not keys:
            raise InputError(f"lmcache: {len(addr.tokens)} tokens hold no complete chunk of {addr.chunk_size}")
        parts, miss = stored_prefix(keys, addr, allow=self.allow_locations, storage_options=self.storage_options,
                                    workers=self.inflight)
        if not parts:
            raise InputError(f"lmcache: no stored prefix of these tokens for model {addr.model!r} under "
                             f"{addr.anchor_path}: {miss}")
        covered = sum(p.header.tokens for p in parts)
        cache_id = joined_cache_id(parts)
        self.joined = join_caches(parts, prompt_token_ids=addr.tokens[:covered],
                                  properties={MODEL_PROPERTY: addr.model},
                                  residual_location=f"lmcache-{cache_id.hex()[:16]}.lynxr")
        self.residual_url = self.residual_url or posixpath.dirname(parts[0].residual_url)
        self.transfer.timeline.extra["lmcache"] = {
            "model": addr.model, "anchor_path": addr.anchor_path, "residual_path": self.residual_url,
            "chunk_size": addr.chunk_size, "chunks_requested": len(keys), "chunks": len(parts), "tokens": covered,
            "miss": miss, "objects": [posixpath.basename(p.anchor_url) for p in parts]}
        self.anchor_size = self.joined.anchor.size
        return self._pump(self.joined.anchor, ANCHOR, "anchor")

    def open_residual(self, header) -> StreamBuffer:
        self._residual_buf = self._pump(self.joined.residual, RESIDUAL, "residual")
        return self._residual_buf


register_transport(SCHEME, LMCacheTransport)
