"""lynxkv's per-user cache directory and the files it keeps there (:func:`cached_file`): built once, atomically,
checked against their SHA-256 each time they are used.

Location: ``$XDG_CACHE_HOME/lynxkv``, else ``~/.cache/lynxkv`` (the XDG base directory rule). Directories lynxkv
creates there are private to the user (mode 0700). Nothing in it is needed: removing it costs a rebuild only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable

from lynxkv.errors import InputError
from lynxkv.storage.atomic import atomic_path

CACHE_ENV = "XDG_CACHE_HOME"
_READ_BLOCK = 1 << 20


def user_cache_dir() -> str:
    """The per-user cache directory (see the module docstring); it may not exist yet."""
    xdg = os.environ.get(CACHE_ENV)
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lynxkv")


def sha256_of(path: str) -> str:
    """The SHA-256 (hex) of the local file ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def cached_file(relative: str, sha256: str, build: Callable[[str], None]) -> str:
    """The path of ``relative`` (``/``-separated) under :func:`user_cache_dir`, a file whose SHA-256 is ``sha256``. If it is missing
    or its contents differ (a truncated or altered copy), ``build(temp_path)`` writes it to a temporary file beside
    it, which is checked and then renamed into place: a reader never sees a partial file, and two processes that
    build at once each publish a whole one. ``build`` may raise; nothing is left behind then."""
    root = user_cache_dir()
    final = os.path.join(root, relative)
    if os.path.isfile(final) and sha256_of(final) == sha256:
        return final
    folder = os.path.dirname(final)
    parts = [p for p in os.path.dirname(relative).split("/") if p]
    try:
        os.makedirs(os.path.dirname(root), exist_ok=True)  # ~/.cache: the system's default mode
        for level in [os.path.join(root, *parts[:i]) for i in range(len(parts) + 1)]:  # root, then down
            with contextlib.suppress(FileExistsError):
                os.mkdir(level, 0o700)  # one level at a time: makedirs gives its mode to the last level only
    except OSError as exc:
        raise InputError(f"cannot create the cache directory {folder} ({exc.strerror or exc}); set "
                         f"${CACHE_ENV} to a writable directory") from None
    with atomic_path(final) as tmp:
        build(tmp)
        got = sha256_of(tmp)
        if got != sha256:
            raise InputError(f"{final}: the file built has SHA-256 {got}, expected {sha256}; nothing was written")
    return final
