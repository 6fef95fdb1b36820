"""The lock of the writers of one path (:func:`writer_lock`), whose file is also their journal (:class:`WriterLock`).

A writer that publishes several files as one object (a two-file cache: the residual, then the anchor) takes the
lock of the anchor's path, ``.NAME.lock`` beside it, held with ``flock``: the kernel releases it if the process
dies, and the writer removes the file on release. Before it creates a file it writes one line to the lock file
(:meth:`WriterLock.note`): the name, what it is to the writer, and its process id. A writer that finishes, or
fails and cleans up, removes the file with its lines; one that is killed leaves them, and the next writer of the
path reads them (:attr:`WriterLock.left`): exactly the names a dead writer of this path created, so that it
removes what that writer left behind and nothing else (a neighbour's file never matches a pattern by chance).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from lynxkv.storage.atomic import _storage_error
from lynxkv.storage.urls import as_lynx_error, is_local, local_path, refuse_nul

LOCK_SUFFIX = ".lock"
KINDS = ("new", "old", "tmp")  # a file the writer creates / one it removes once done / one it only overwrites


@dataclass(frozen=True)
class Note:
    """One line of a writer's journal: ``kind`` (see :data:`KINDS`) of the file ``name``, by process ``pid``."""

    kind: str
    name: str
    pid: int


class WriterLock:
    """A held :func:`writer_lock`. ``left``: the notes of earlier writers of the path that were killed (read
    when the lock was taken); :meth:`note` records one of this writer's, :meth:`settled` forgets ``left``."""

    def __init__(self, final: str, fd: int | None = None):
        self.final, self._fd = final, fd
        self.left: list[Note] = [] if fd is None else _read_notes(fd)

    def note(self, kind: str, name: str) -> None:
        """Record, before creating or removing it, that this writer is about to touch the file ``name``."""
        if self._fd is None:
            return
        if kind not in KINDS:
            raise ValueError(f"note: kind {kind!r} is not one of {KINDS}")
        line = json.dumps({"kind": kind, "name": os.fspath(name), "pid": os.getpid()}) + "\n"
        try:
            os.lseek(self._fd, 0, os.SEEK_END)
            view = memoryview(line.encode())
            while view:  # a write may take part of the line (a nearly full disk), the next one fails
                view = view[os.write(self._fd, view):]
        except OSError as exc:
            raise _storage_error(self.final, exc) from None

    def settled(self) -> None:
        """The notes in ``left`` are dealt with: drop them (this writer's own notes follow)."""
        if self._fd is not None and self.left:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
        self.left = []


def _read_notes(fd: int) -> list[Note]:
    """The complete lines of the lock file (a writer killed while writing one leaves a partial last line: it
    had not created that file yet)."""
    chunks = []
    with contextlib.suppress(OSError):
        os.lseek(fd, 0, os.SEEK_SET)
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    notes = []
    for line in b"".join(chunks).split(b"\n"):
        try:
            d = json.loads(line)
            note = Note(str(d["kind"]), str(d["name"]), int(d["pid"]))
        except (ValueError, KeyError, TypeError):
            continue
        if note.kind in KINDS and note.name:
            notes.append(note)
    return notes


@contextlib.contextmanager
def writer_lock(final: str | os.PathLike, *, make_dirs: bool = False) -> Iterator[WriterLock]:
    """Hold the lock of the writers of ``final`` (a local path) while the block runs; yield a
    :class:`WriterLock`. Writers of one object take turns, so that one never removes what another is writing.

    A waiter checks that the file it locked is still the one under the name, so removing it on release is safe.
    Readers take no lock. Object stores and URLs: no lock and no journal (their writes are single PUTs)."""
    final = os.fspath(final)
    if not is_local(final):
        yield WriterLock(final)
        return
    import fcntl

    refuse_nul(final)  # os.open of the lock would raise a bare ValueError ("embedded null byte")
    path = os.path.abspath(local_path(final))
    d, base = os.path.split(path)
    if make_dirs:
        with contextlib.suppress(OSError):
            os.makedirs(d, exist_ok=True)
    if not os.path.isdir(d):
        yield WriterLock(final)  # the writer reports the missing directory
        return
    lock = os.path.join(d, f".{base}{LOCK_SUFFIX}")
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise as_lynx_error(final, exc) from None
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            held, named = os.fstat(fd), os.stat(lock)
            if (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed it while we waited: lock the one under the name now
    try:
        yield WriterLock(final, fd)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # before the unlock: a waiter on this file sees it is gone and retries
        os.close(fd)
