"""Sending a cache over two TCP connections (anchor, residual) with strict priority, a rate limit and DSCP marks.

Wire protocol, version 1 (all integers little-endian). Every message is a frame:

    offset  size  field
    0       2     magic    b"LK"
    2       1     version  1
    3       1     type     1 HELLO, 2 MANIFEST, 3 DATA, 4 END, 5 ERROR
    4       4     length   payload bytes, <= 16 MiB (MAX_PAYLOAD)
    8       ...   payload

- HELLO (client -> server), UTF-8 JSON: ``{"stream": "anchor" | "residual", "offset": N}``. One connection carries
  one segment from byte ``offset`` on (a reconnect after a reset resumes where it stopped).
- MANIFEST (server -> client), JSON: ``{"anchor": {"name", "size", "crc32"}, "residual": {...} | null}``; sent
  first on every connection (``name`` is the anchor's file name and, for the residual, the location its anchor
  header records).
- DATA: raw segment bytes, in order, starting at the requested offset (at most BLOCK bytes each).
- END, JSON ``{"bytes": size, "crc32": crc}``: the segment is complete; the client checks the size and the CRC-32
  of the whole segment.
- ERROR, UTF-8 text: the server refuses (bad hello, unknown stream); the client raises it as a LynxError.

A frame with the wrong magic, an unknown version or type, an oversized length, or a connection that ends inside a
frame is a :class:`ProtocolError` (a LynxError): the receiver never writes a partial segment under its real name.

Priority. The server sends both connections through ONE :class:`EmulatedLink` (optionally rate-limited): while the
anchor connection has bytes left, the residual connection waits (strict priority); the anchor socket can carry a
higher DSCP class (IP_TOS) than the residual so that routers on a real, shared link keep the same order. With
``app_priority=False`` both connections send at once and only the network's DSCP classes order them (see
tests/test_stream_netns.py: a veth link shaped by tc with an HTB class per DSCP class).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

from lynxkv.errors import InputError, LynxError
from lynxkv.stream.link import ANCHOR, RESIDUAL, STREAM_NAMES, EmulatedLink
from lynxkv.errors import TransientError

MAGIC = b"LK"
VERSION = 1
HELLO, MANIFEST, DATA, END, ERROR = 1, 2, 3, 4, 5
FRAME_TYPES = (HELLO, MANIFEST, DATA, END, ERROR)
HEADER = struct.Struct("<2sBBI")  # magic 2 + version 1 + type 1 + length 4 = 8 bytes
MAX_PAYLOAD = 16 << 20
BLOCK = 256 << 10

# DSCP code points (RFC 4594 / 2474); IP_TOS carries DSCP << 2.
DSCP = {"BE": 0, "CS0": 0, "CS1": 8, "AF11": 10, "AF12": 12, "AF13": 14, "CS2": 16, "AF21": 18, "AF22": 20,
        "AF23": 22, "CS3": 24, "AF31": 26, "AF32": 28, "AF33": 30, "CS4": 32, "AF41": 34, "AF42": 36,
        "AF43": 38, "CS5": 40, "EF": 46, "CS6": 48, "CS7": 56}


class ProtocolError(LynxError):
    """A malformed or truncated frame of the lynxkv TCP protocol."""


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


def set_dscp(sock: socket.socket, dscp: int) -> int:
    """Mark ``sock``'s packets with ``dscp``; return the TOS byte the kernel reports back."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


# ---------------------------------------------------------------------------------------------------- framing


def encode_frame(kind: int, payload: bytes) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, VERSION, kind, len(payload)) + payload


def _recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except (ConnectionError, socket.timeout, OSError) as exc:
            raise TransientError(f"connection lost while reading {what}: {exc}") from None
        if not chunk:
            if not buf and what == "frame header":
                raise TransientError("connection closed by the peer")
            raise TransientError(f"connection closed inside {what} ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def decode_header(raw: bytes) -> tuple[int, int]:
    """Validate a frame header, in field order; return (type, length)."""
    magic, version, kind, length = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"frame magic: expected {MAGIC!r}, got {magic!r} (not a lynxkv stream?)")
    if version != VERSION:
        raise ProtocolError(f"frame version: expected {VERSION}, got {version}")
    if kind not in FRAME_TYPES:
        raise ProtocolError(f"frame type: expected one of {FRAME_TYPES}, got {kind}")
    if length > MAX_PAYLOAD:
        raise ProtocolError(f"frame length: expected <= {MAX_PAYLOAD}, got {length}")
    return kind, length


def read_frame(sock: socket.socket) -> tuple[int, bytes]:
    kind, length = decode_header(_recv_exact(sock, HEADER.size, "frame header"))
    return kind, _recv_exact(sock, length, "frame payload")


def _json(payload: bytes, what: str) -> dict:
    try:
        obj = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{what} frame: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what} frame: expected a JSON object")
    return obj


def check_manifest(m: dict) -> dict:
    """A MANIFEST must describe an anchor and, optionally, a residual with a name, a size and a CRC-32."""
    for key in ("anchor", "residual"):
        d = m.get(key)
        if d is None and key == "residual":
            continue
        if not isinstance(d, dict):
            raise ProtocolError(f"MANIFEST frame: `{key}` must be an object")
        if not isinstance(d.get("name"), str):
            raise ProtocolError(f"MANIFEST frame: `{key}.name` must be a string")
        for field_name, cap in (("size", 1 << 48), ("crc32", 1 << 32)):
            v = d.get(field_name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < cap:
                raise ProtocolError(f"MANIFEST frame: `{key}.{field_name}` must be an integer in [0, {cap})")
    return m


# ---------------------------------------------------------------------------------------------------- server


@dataclass
class SegmentFile:
    name: str  # as announced in the manifest
    data: bytes

    def describe(self) -> dict:
        return {"name": self.name, "size": len(self.data), "crc32": zlib.crc32(self.data)}


@dataclass
class ServerStats:
    connections: list = field(default_factory=list)  # dicts: stream, offset, bytes, tos, seconds
    completed: dict = field(default_factory=lambda: {"anchor": 0, "residual": 0})


class CacheServer:
    """Serves one cache (its anchor and residual bytes) to any number of clients, one segment per connection."""

    def __init__(self, anchor: SegmentFile, residual: SegmentFile | None, *, host: str = "127.0.0.1",
                 port: int = 0, bandwidth: float | None = None, latency: float = 0.0,
                 dscp_anchor: int | None = None, dscp_residual: int | None = None,
                 log: Callable[[str], None] | None = None, block: int = BLOCK, app_priority: bool = True):
        self.block = block
        self.app_priority = app_priority
        self.segments = {"anchor": anchor, "residual": residual}
        self.manifest = encode_frame(MANIFEST, json.dumps(
            {"anchor": anchor.describe(), "residual": residual.describe() if residual else None}).encode())
        self.link = EmulatedLink(bandwidth, latency)
        self.dscp = {"anchor": dscp_anchor, "residual": dscp_residual}
        self.stats = ServerStats()
        self.log = log or (lambda msg: None)
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.settimeout(0.2)
        self.host, self.port = self._sock.getsockname()[:2]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread: threading.Thread | None = None

    # -- lifecycle
    def start(self) -> "CacheServer":
        self._thread = threading.Thread(target=self.serve_forever, name="lynxkv-serve", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self, until: Callable[[], bool] | None = None) -> None:
        while not self._stop.is_set() and not (until and until()):
            try:
                conn, addr = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            t = threading.Thread(target=self._handle, args=(conn,), name="lynxkv-serve-conn", daemon=True)
            t.start()
            self._threads.append(t)
        for t in self._threads:
            t.join(timeout=5)

    def close(self) -> None:
        self._stop.set()
        try:
            self._sock.close()
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "CacheServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- one connection
    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(30)
        t_start = time.perf_counter()
        with conn:
            try:
                kind, payload = read_frame(conn)
                if kind != HELLO:
                    raise ProtocolError(f"expected a HELLO frame first, got type {kind}")
                hello = _json(payload, "HELLO")
                name = hello.get("stream")
                offset = hello.get("offset", 0)
                seg = self.segments.get(name) if name in STREAM_NAMES else None
                if seg is None:
                    raise ProtocolError(f"HELLO: unknown or unavailable stream {name!r}")
                if not isinstance(offset, int) or not 0 <= offset <= len(seg.data):
                    raise ProtocolError(f"HELLO: offset {offset!r} outside 0..{len(seg.data)}")
            except LynxError as exc:
                try:
                    conn.sendall(encode_frame(ERROR, str(exc).encode()))
                except OSError:
                    pass
                self.log(f"refused a connection: {exc}")
                return
            stream = ANCHOR if name == "anchor" else RESIDUAL
            tos = set_dscp(conn, self.dscp[name]) if self.dscp[name] is not None else None
            record = {"stream": name, "offset": offset, "bytes": 0, "tos": tos, "seconds": None}
            self.stats.connections.append(record)
            try:
                conn.sendall(self.manifest)
                view = memoryview(seg.data)
                # The anchor holds the link until its last byte is out. Without application priority both
                # connections send at once and the network's DSCP classes alone decide who goes first.
                with self.link.hold(stream) if self.app_priority else contextlib.nullcontext():
                    for a in range(offset, len(seg.data), self.block):
                        if self._stop.is_set():
                            return
                        block = view[a:a + self.block]
                        if self.app_priority or self.link.bandwidth is not None:
                            self.link.send(stream if self.app_priority else ANCHOR, len(block))
                        conn.sendall(encode_frame(DATA, bytes(block)))
                        record["bytes"] += len(block)
                conn.sendall(encode_frame(END, json.dumps(
                    {"bytes": len(seg.data), "crc32": zlib.crc32(seg.data)}).encode()))
                record["seconds"] = time.perf_counter() - t_start
                self.stats.completed[name] += 1
                self.log(f"sent {name}: {record['bytes']} bytes from offset {offset}")
            except OSError as exc:
                self.log(f"{name} connection lost: {exc}")


# ---------------------------------------------------------------------------------------------------- client


def parse_tcp_url(url: str) -> tuple[str, int]:
    rest = url.split("://", 1)[1] if "://" in url else url
    host, _, port = rest.rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"{url}: expected tcp://HOST:PORT")
    return host.strip("[]"), int(port)


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise TransientError(f"cannot connect to {host}:{port}: {exc}") from None


class TcpSource:
    """Ordered ``(offset, data)`` blocks of one segment from a lynxkv server; reconnects and resumes from the
    last byte received on a reset (``attempts`` tries with exponential backoff); checks size and CRC-32 at END."""

    def __init__(self, url: str, stream: str, *, start: int = 0, attempts: int = 4, backoff: float = 0.05,
                 timeout: float = 10.0, on_retry: Callable[[str], None] | None = None):
        self.host, self.port = parse_tcp_url(url)
        self.stream, self.segment = stream, stream
        self.start = start
        self.attempts, self.backoff, self.timeout = attempts, backoff, timeout
        self.on_retry = on_retry
        self.manifest: dict | None = None
        self.retries = 0
        self._sock: socket.socket | None = None

    def fetch_manifest(self) -> dict:
        """Connect the stream (if not yet) and return the server's manifest."""
        if self.manifest is None:
            self._open(self.start)
        return self.manifest  # type: ignore[return-value]

    def _open(self, offset: int) -> None:
        sock = _connect(self.host, self.port, self.timeout)
        try:
            sock.sendall(encode_frame(HELLO, json.dumps({"stream": self.stream, "offset": offset}).encode()))
            kind, payload = read_frame(sock)
            if kind == ERROR:
                raise LynxError(f"server refused the {self.stream} stream: {payload.decode('utf-8', 'replace')}")
            if kind != MANIFEST:
                raise ProtocolError(f"expected a MANIFEST frame, got type {kind}")
            manifest = check_manifest(_json(payload, "MANIFEST"))
            if self.manifest is not None and manifest != self.manifest:
                raise LynxError("the server's cache changed between reconnects")
            self.manifest = manifest
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        got = self.start
        crc = 0  # running CRC-32 of the bytes received (meaningful when the stream started at byte 0)
        crc_ok = None
        k = 0
        try:
            while True:
                try:
                    if self._sock is None:
                        self._open(got)
                    desc = self.manifest.get(self.stream) if self.manifest else None
                    if not isinstance(desc, dict):
                        raise LynxError(f"the server offers no {self.stream} segment")
                    while True:
                        kind, payload = read_frame(self._sock)
                        if kind == DATA:
                            if got + len(payload) > desc["size"]:
                                raise ProtocolError(f"{self.stream}: server sent more than {desc['size']} bytes")
                            crc = zlib.crc32(payload, crc)
                            yield got, payload
                            got += len(payload)
                        elif kind == END:
                            crc_ok = _json(payload, "END")
                            break
                        elif kind == ERROR:
                            raise LynxError(f"server error: {payload.decode('utf-8', 'replace')}")
                        else:
                            raise ProtocolError(f"unexpected frame type {kind} in the {self.stream} stream")
                    break
                except TransientError as exc:
                    self.close()
                    k += 1
                    if k >= self.attempts:
                        raise TransientError(f"{self.stream} stream from {self.host}:{self.port} failed after "
                                             f"{self.attempts} attempts: {exc}") from None
                    self.retries += 1
                    if self.on_retry:
                        self.on_retry(f"{self.stream} stream: {exc}; reconnecting at byte {got} (retry {k})")
                    time.sleep(min(1.0, self.backoff * 2 ** (k - 1)))
        finally:
            self.close()
        if got != crc_ok.get("bytes") or got != desc["size"]:
            raise ProtocolError(f"{self.stream}: END says {crc_ok.get('bytes')} bytes, received {got}")
        if self.start == 0 and crc != desc["crc32"]:
            from lynxkv.errors import ChecksumError

            raise ChecksumError(f"{self.stream} segment: CRC-32 {crc:08x} after transfer, the server announced "
                                f"{desc['crc32']:08x}", field="crc32", where=self.stream)


def receive_segments(url: str, *, on_block: Callable[[str, int, int], None] | None = None,
                     attempts: int = 4) -> tuple[dict, bytes, bytes | None]:
    """Receive both segments concurrently (anchor and residual connections); return (manifest, anchor, residual).

    Each segment's CRC-32 is checked against the manifest; ``on_block(stream, bytes_so_far, size)`` reports
    progress. The caller writes the files (atomically)."""
    import concurrent.futures as cf

    first = TcpSource(url, "anchor", attempts=attempts)
    manifest = first.fetch_manifest()
    results: dict[str, bytes] = {}

    def pull(src: TcpSource) -> None:
        desc = manifest[src.stream]
        buf = bytearray()
        for _, data in src:
            buf += data
            if on_block:
                on_block(src.stream, len(buf), desc["size"])
        if zlib.crc32(buf) != desc["crc32"]:
            from lynxkv.errors import ChecksumError

            raise ChecksumError(f"{src.stream} segment: CRC-32 {zlib.crc32(buf):08x} after transfer, the "
                                f"server announced {desc['crc32']:08x}", field="crc32", where=src.stream)
        results[src.stream] = bytes(buf)

    sources = [first]
    if manifest.get("residual"):
        sources.append(TcpSource(url, "residual", attempts=attempts))
    with cf.ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(pull, s) for s in sources]:
            f.result()
    return manifest, results["anchor"], results.get("residual")
