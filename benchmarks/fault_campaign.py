"""Faults on purpose: SIGKILL lynxkv's writers at random points and fill their disk, then check every cache path.

    python benchmarks/fault_campaign.py --kills 1000 --full-disk 20 [--json out.json] [--seed 1]

Writers (each the entry users run, in a child forked from this pre-imported process, so a kill costs a fork, not
a torch import): ``lynxkv encode`` (``lynxkv.cli.main``) replacing a two-file cache, or writing it where none is;
``lynxkv tier`` moving the residual and the anchor back and forth, and (``tier-exact``) the exact segment of a
cache with an exact segment and its anchor; ``lynxkv stream -o`` replacing a saved copy;
the LMCache tier's store (``LynxL2Adapter._store``, the method LMCache's worker calls, run against stand-ins for
the five LMCache names the adapter imports, since LMCache is not installed in the main venv).

Each kill: the child starts the command, the parent sends SIGKILL after a random delay drawn uniformly from 0 to
1.1x the command's unkilled median duration (from the fork to its exit), then checks the cache path with :func:`lynxkv.cache.verify_file`
(every header, index and page CRC, the residual's cache id) and reads which cache it is (a header property, or the
cache id). States: ``old``, ``new``, ``absent`` (only where no cache was there before: a first write) -- anything
else is a cache *lost* (absent where one was) or *mixed* (present but not whole). Leftovers are files beside the
cache that no cache references (temporaries, orphaned residuals); right after a kill some are expected, and the
next writer of the same path must remove them: the campaign counts what is left after each writer that ran to
completion, which must be 0.

Full disk: a tmpfs of fixed size mounted in a private mount namespace (``unshare(CLONE_NEWNS)``, needs root or
a user namespace), filled by a filler file to leave a random share of what the write needs; the writer runs to
the end and must fail with exit code 1 and one ``lynxkv: error:`` line on its stderr, no traceback (or succeed
if it fit), leaving the old cache whole and no leftover.
Without mount rights it falls back to ``RLIMIT_FSIZE`` in the child (writes past the limit fail with EFBIG): that
covers a write that fails part-way, not a full directory or a failing fsync.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import random
import re
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
import types

CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x00020000, 0x4000, 0x40000


def private_mounts() -> bool:
    """Enter a mount namespace of our own (before torch starts threads) so that tmpfs mounts stay ours."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        return False
    return libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) == 0


def mount_tmpfs(path: str, size: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    os.makedirs(path, exist_ok=True)
    return libc.mount(b"tmpfs", path.encode(), b"tmpfs", 0, f"size={size}".encode()) == 0


def umount(path: str) -> None:
    ctypes.CDLL(None, use_errno=True).umount2(path.encode(), 2)  # MNT_DETACH


MOUNTS = private_mounts() if __name__ == "__main__" else False

import torch  # noqa: E402  (after the namespace: unshare needs a single thread)

from lynxkv.cache import open_cache, residual_file_of, verify_file  # noqa: E402
from lynxkv.cache.dumps import save_kv_safetensors  # noqa: E402
from lynxkv.cli import main as cli_main  # noqa: E402
from lynxkv.cli.app import build_command  # noqa: E402
from lynxkv.errors import LynxError  # noqa: E402

METHOD = "tmpfs"
WHICH = "fault.which"  # the header property that names a cache in the campaign


# ------------------------------------------------------------------------------------------ LMCache stand-ins
def lmcache_stand_ins() -> None:
    """The five LMCache names ``lynxkv.integrations.lmcache.adapter`` imports, as inert stand-ins (the store path
    only touches the logger, the task result and the key fields)."""
    import logging
    from collections import namedtuple

    class Notifier:
        def fileno(self):
            return -1

        def notify(self):
            pass

        def close(self):
            pass

    class Base:
        def __init__(self):
            pass

        def _notify_keys_stored(self, *a):
            pass

        _notify_keys_accessed = _notify_keys_deleted = _notify_keys_stored

    mods = {n: types.ModuleType(n) for n in ("lmcache", "lmcache.lmcache_native", "lmcache.logging", "lmcache.v1",
                                             "lmcache.v1.distributed", "lmcache.v1.distributed.api",
                                             "lmcache.v1.distributed.internal_api", "lmcache.v1.distributed.l2_adapters",
                                             "lmcache.v1.distributed.l2_adapters.base", "lmcache.v1.platform",
                                             "lmcache.v1.distributed.serde")}
    mods["lmcache.lmcache_native"].Bitmap = object
    mods["lmcache.logging"].init_logger = logging.getLogger
    mods["lmcache.v1.distributed.api"].ObjectKey = namedtuple(
        "ObjectKey", "chunk_hash model_name kv_rank object_group_id cache_salt")
    mods["lmcache.v1.distributed.internal_api"].L2StoreResult = namedtuple("L2StoreResult", "ok nbytes")
    mods["lmcache.v1.distributed.l2_adapters.base"].L2AdapterInterface = Base
    mods["lmcache.v1.platform"].create_event_notifier = Notifier
    for name, m in mods.items():
        sys.modules.setdefault(name, m)
    sys.modules["lynxkv.integrations.lmcache.serde"] = types.ModuleType("lynxkv.integrations.lmcache.serde")


# ------------------------------------------------------------------------------------------ children
def run_child(fn, *, fsize: int | None = None, stderr: str | None = None) -> int:
    """Fork; the child runs ``fn()`` (returning an exit code) with stdout to /dev/null, stderr too or to the file
    ``stderr``. An exception that escapes ``fn`` exits 70 (what the CLI never does on its own)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if stderr else null, 2)
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
            code = fn()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code if isinstance(code, int) else 0)
    return pid


def wait(pid: int, timeout: float = 120.0) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise RuntimeError(f"child {pid} hung for {timeout} s")


def kill_after(pid: int, delay: float) -> bool:
    """SIGKILL ``pid`` after ``delay`` s; True if it was still running (the kill landed)."""
    time.sleep(delay)
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        return False
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return True


def cli(argv):
    return lambda: cli_main(list(argv))


# ------------------------------------------------------------------------------------------ states
def identity(path: str, residual: str | None = None, allow=()) -> str | None:
    """Which cache is whole at ``path`` (its WHICH property, else its cache id); None if absent; 'broken' if a
    file is there that is not a whole cache."""
    if not os.path.lexists(path):
        return None
    try:
        if verify_file(path, residual=residual, allow_locations=allow):
            return "broken"
        with open_cache(path, residual=residual, allow_locations=allow) as cache:
            return cache.info.properties.get(WHICH) or cache.info.cache_id
    except (LynxError, OSError):
        return "broken"


def residual_of(anchor: str, allow=()) -> str | None:
    """The residual file the anchor at ``anchor`` records (under ``allow``), if it is a local file."""
    from lynxkv.storage import resolve_location

    try:
        with open_cache(anchor, allow_locations=allow) as cache:
            loc = cache.info.residual_location
            return None if loc is None else resolve_location(cache.name, loc, allow=allow)
    except LynxError:
        return None


def leftovers(sc, ignore=()) -> list[str]:
    """Files in the scenario's directories that no cache there references."""
    keep = {os.path.abspath(p) for p in ignore}
    for a in sc.anchors():
        if os.path.isfile(a):
            keep.add(os.path.abspath(a))
            keep.update(os.path.abspath(f) for f in sc.side_files(a))
    out = []
    for d in sc.dirs():
        for n in os.listdir(d):
            p = os.path.abspath(os.path.join(d, n))
            if p not in keep and os.path.isfile(p) and sc.owns(p):
                out.append(p)
    return sorted(out)


# ------------------------------------------------------------------------------------------ scenarios
def kv(seed: int, layers=4, heads=2, tokens=256, dim=64):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16),
             torch.randn(heads, tokens, dim, generator=g).to(torch.bfloat16)) for _ in range(layers)]


class Scenario:
    """A writer and the cache paths it may touch; ``op()`` gives the next command and what it may leave."""

    name = ""

    def __init__(self, root: str, assets: str):
        self.root, self.assets = root, assets
        os.makedirs(root, exist_ok=True)

    def dirs(self) -> list[str]:
        return [self.root]

    def anchors(self) -> list[str]:
        raise NotImplementedError

    def residual_of(self, anchor: str) -> str | None:
        return residual_of(anchor)

    def side_files(self, anchor: str) -> list[str]:
        """The files besides the anchor that the cache at ``anchor`` references."""
        r = self.residual_of(anchor)
        return [r] if r else []

    def owns(self, path: str) -> bool:
        return True

    def identity(self, anchor: str) -> str | None:
        return identity(anchor)

    def check(self, before, allowed):
        """(state of each anchor path now, the state each had before, the states a write may leave)."""
        return {p: self.identity(p) for p in self.anchors()}, before, allowed


class Encode(Scenario):
    """``lynxkv encode DUMP -o x.lynx --force``: A and B alternate; a quarter of the writes find no cache there."""

    name = "encode"

    def __init__(self, root, assets):
        super().__init__(root, assets)
        self.path = os.path.join(root, "x.lynx")

    def anchors(self):
        return [self.path]

    def prepare(self, rng):
        now = identity(self.path)
        if now in ("A", "B") and rng.random() < 0.25:
            r = residual_file_of(self.path)
            os.unlink(self.path)
            if r:
                os.unlink(r)
            now = None
        new = "B" if now == "A" else "A"
        return now, {new}, cli(["encode", os.path.join(self.assets, f"{new}.safetensors"), "-o", self.path,
                                "--force"])


class Stream(Encode):
    """``lynxkv stream SRC -o x.lynx --force``: the copies of caches A and B alternate."""

    name = "stream"

    def prepare(self, rng):
        now, allowed, _ = super().prepare(rng)
        new = next(iter(allowed))
        return now, allowed, cli(["stream", os.path.join(self.assets, new, "c.lynx"), "-o", self.path, "--force"])


class Tier(Scenario):
    """``lynxkv tier``: the residual to another directory and back, then the anchor to another name and back."""

    name = "tier"
    MOVES = (("a", "--residual-out", "far/c.lynxr"), ("a", "--residual-out", "near/c.lynxr"),
             ("a", "b", None), ("b", "a", None))

    def __init__(self, root, assets):
        super().__init__(root, assets)
        for d in ("near", "far"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.a, self.b = os.path.join(root, "near", "c.lynx"), os.path.join(root, "near", "d.lynx")
        self.step = 0
        shutil.copy(os.path.join(assets, "A", "c.lynx"), self.a)
        shutil.copy(os.path.join(assets, "A", "c.lynxr"), os.path.join(root, "near", "c.lynxr"))

    def dirs(self):
        return [os.path.join(self.root, d) for d in ("near", "far")]

    def anchors(self):
        return [self.a, self.b]

    def prepare(self, rng):
        src, dst, res = self.MOVES[self.step % len(self.MOVES)]
        src_path = self.a if src == "a" else self.b
        if res is not None:
            argv = ["tier", src_path, "--residual-out", os.path.join(self.root, res)]
        else:
            argv = ["tier", src_path, self.a if dst == "a" else self.b]
        self.pending = (src_path, argv)
        return "A", {"A"}, cli(argv)

    def done(self, rc: int | None) -> None:
        """The move ran to its end: the next one (a killed move is run again, as a user would)."""
        if rc == 0:
            self.step += 1

    def residual_of(self, anchor):
        return residual_of(anchor, allow=[self.root])

    def identity(self, anchor):
        return identity(anchor, allow=[self.root])

    def check(self, before, allowed):
        got = {p: self.identity(p) for p in self.anchors()}
        if all(v is None for v in got.values()):
            return got, {p: "A" for p in got}, allowed  # lost: neither name holds it
        return got, {p: v for p, v in got.items() if v is None or v == "A"}, allowed


class TierExact(Tier):
    """``lynxkv tier`` on a cache: the exact segment to another directory and back, then the anchor to
    another name and back (its recorded exact location rewritten each time)."""

    name = "tier-exact"
    MOVES = (("a", "--exact-out", "far/c.lynxe"), ("a", "--exact-out", "near/c.lynxe"),
             ("a", "b", None), ("b", "a", None))

    def __init__(self, root, assets):
        Scenario.__init__(self, root, assets)
        for d in ("near", "far"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        self.a, self.b = os.path.join(root, "near", "c.lynx"), os.path.join(root, "near", "d.lynx")
        self.step = 0
        for suffix in (".lynx", ".lynxr", ".lynxe"):
            shutil.copy(os.path.join(assets, "E", "c" + suffix), os.path.join(root, "near", "c" + suffix))

    def prepare(self, rng):
        src, dst, res = self.MOVES[self.step % len(self.MOVES)]
        src_path = self.a if src == "a" else self.b
        if res is not None:
            argv = ["tier", src_path, "--exact-out", os.path.join(self.root, res)]
        else:
            argv = ["tier", src_path, self.a if dst == "a" else self.b]
        self.pending = (src_path, argv)
        return "E", {"E"}, cli(argv)

    def side_files(self, anchor):
        from lynxkv.storage import resolve_location

        files = super().side_files(anchor)
        try:
            with open_cache(anchor, allow_locations=[self.root]) as cache:
                loc = cache.info.exact_location
                if loc is not None:
                    files.append(resolve_location(cache.name, loc, allow=[self.root], what="exact segment"))
        except LynxError:
            pass
        return files

    def check(self, before, allowed):  # identity() verifies the exact segment too (its CRCs and rebuild)
        got = {p: self.identity(p) for p in self.anchors()}
        if all(v is None for v in got.values()):
            return got, {p: "E" for p in got}, allowed
        return got, {p: v for p, v in got.items() if v is None or v == "E"}, allowed


class LMCacheTier(Scenario):
    """The LMCache tier's store of a chunk (``LynxL2Adapter._store``), anchors and residuals on two paths."""

    name = "lmcache"

    def __init__(self, root, assets):
        super().__init__(root, assets)
        lmcache_stand_ins()
        from lynxkv.integrations.lmcache.adapter import LynxL2Adapter
        from lynxkv.integrations.lmcache.chunk import encode_chunk
        from lynxkv.integrations.lmcache.source import key_cache_id, object_name
        from lmcache.v1.distributed.api import ObjectKey

        self.fast, self.bulk = os.path.join(root, "fast"), os.path.join(root, "bulk")
        self.adapter = LynxL2Adapter({"anchor_path": self.fast, "residual_path": self.bulk, "workers": 1})
        self.object_name = object_name
        self.keys = [ObjectKey(bytes([i]) * 16, "m/x", 0, 0, None) for i in range(3)]
        g = torch.Generator().manual_seed(3)
        chunk = torch.randn(2, 4, 256, 128, generator=g).to(torch.bfloat16)
        self.objects = {k: types.SimpleNamespace(byte_array=bytearray(
            encode_chunk(chunk, kv_heads=2, model_name=k.model_name, cache_id=key_cache_id(k)))) for k in self.keys}
        self.ids = {k: key_cache_id(k).hex() for k in self.keys}

    def dirs(self):
        return [self.fast, self.bulk]

    def anchors(self):
        return [self.adapter.paths(k)[0] for k in self.keys]

    def prepare(self, rng):
        self.key = rng.choice(self.keys)
        apath, rpath = self.adapter.paths(self.key)
        if os.path.exists(apath):
            self.adapter.delete([self.key])
        key, obj = self.key, self.objects[self.key]
        return None, {self.ids[key]}, lambda: self.adapter._store(1, [key], [obj]) or 0

    def residual_of(self, anchor):
        return os.path.join(self.bulk, os.path.basename(anchor) + "r")

    def identity(self, anchor):
        return identity(anchor, residual=self.residual_of(anchor))

    def owns(self, path):
        """Leftovers are a key's own business: the next store of that key replaces them."""
        return self.object_name(self.key) in os.path.basename(path)

    def check(self, before, allowed):
        apath, _ = self.adapter.paths(self.key)
        return {apath: self.identity(apath)}, {apath: before[apath]}, allowed


SCENARIOS = {s.name: s for s in (Encode, Tier, TierExact, Stream, LMCacheTier)}


def make_assets(assets: str) -> None:
    for which, seed in (("A", 1), ("B", 2)):
        dump = os.path.join(assets, f"{which}.safetensors")
        save_kv_safetensors(dump, kv(seed), metadata={WHICH: which})
        os.makedirs(os.path.join(assets, which), exist_ok=True)
        assert run_child_wait(cli(["encode", dump, "-o", os.path.join(assets, which, "c.lynx")])) == 0
    dump = os.path.join(assets, "E.safetensors")  # a cache with an exact segment
    save_kv_safetensors(dump, kv(3), metadata={WHICH: "E"})
    os.makedirs(os.path.join(assets, "E"), exist_ok=True)
    assert run_child_wait(cli(["encode", dump, "-o", os.path.join(assets, "E", "c.lynx"), "--exact"])) == 0


def run_child_wait(fn, **kw) -> int:
    return wait(run_child(fn, **kw))


# ------------------------------------------------------------------------------------------ the campaign
class Tally:
    def __init__(self):
        self.kills = self.landed = self.completed = 0
        self.states = {"old": 0, "new": 0, "absent": 0}
        self.lost = self.mixed = 0
        self.left_kinds: dict[str, int] = {}  # what the kills left, by kind of name
        self.left_after_kill = 0  # files no cache references, right after a kill (the next writer removes them)
        self.left_after_writer = 0  # ... after a writer that ran to its end: must be 0
        self.failures: list[str] = []
        self.full_disk = {"events": 0, "failed_cleanly": 0, "fit": 0, "other_rc": 0}
        self.durations: dict[str, float] = {}
        self.child_s: list[float] = []  # how long each unkilled command ran

    def judge(self, sc, got, before, allowed, where: str) -> None:
        for path, state in got.items():
            prior = before.get(path)
            if state is None:
                if prior is not None:
                    self.lost += 1
                    self.failures.append(f"{where}: {path} lost (was {prior})")
                else:
                    self.states["absent"] += 1
            elif state == prior:
                self.states["old"] += 1
            elif state in allowed:
                self.states["new"] += 1
            else:
                self.mixed += 1
                self.failures.append(f"{where}: {path} is {state!r} (was {prior!r}, allowed {sorted(allowed)})")


def one(sc, rng, tally: Tally, delay: float | None, fsize: int | None = None) -> int | None:
    before_id, allowed, fn = sc.prepare(rng)
    before = {p: sc.identity(p) for p in sc.anchors()}
    t = time.perf_counter()
    pid = run_child(fn, fsize=fsize)
    rc = None
    if delay is None:
        rc = wait(pid)
        tally.child_s.append(time.perf_counter() - t)
    else:
        tally.kills += 1
        if kill_after(pid, delay):
            tally.landed += 1
        else:
            rc = 0
            tally.completed += 1
    if hasattr(sc, "done"):
        sc.done(rc)
    got, expect_before, allowed = sc.check(before, allowed)
    tally.judge(sc, got, expect_before, allowed, f"{sc.name} kill#{tally.kills}" if delay is not None else sc.name)
    left = leftovers(sc)
    if rc is None:
        tally.left_after_kill += len(left)
        for p in left:
            kind = f"{sc.name}: " + re.sub(r"[0-9a-f]{8}", "<hex>", re.sub(r"\.\d+-[0-9a-f]{8}\.tmp$", ".<pid>.tmp",
                                                                           os.path.basename(p)))
            tally.left_kinds[kind] = tally.left_kinds.get(kind, 0) + 1
    elif left:
        tally.left_after_writer += len(left)
        tally.failures.append(f"{sc.name}: after a writer that finished (rc {rc}): {[os.path.basename(p) for p in left]}")
    return rc


def median_duration(sc, rng, n=5) -> float:
    """The median time of the command, from the fork to its exit (the span a kill may fall in)."""
    t = Tally()
    for _ in range(n):
        one(sc, rng, t, None)
    return statistics.median(t.child_s)


def full_disk_event(name: str, assets: str, work: str, rng, tally: Tally, idx: int) -> None:
    disk = os.path.join(work, f"disk{idx}")
    size = 4 << 20
    if MOUNTS and METHOD == "tmpfs" and mount_tmpfs(disk, size):
        mounted = True
    else:
        mounted = False
        os.makedirs(disk, exist_ok=True)
    try:
        sc = SCENARIOS[name](os.path.join(disk, name), assets)
        for _ in range(2):  # an old cache in place (a tier move is ready as is)
            if not name.startswith("tier"):
                one(sc, rng, Tally(), None)
        need = max(4096, sum(os.path.getsize(os.path.join(d, n)) for d in sc.dirs() for n in os.listdir(d)
                             if os.path.isfile(os.path.join(d, n))))  # about what one write of this cache needs
        before_id, allowed, fn = sc.prepare(rng)
        before = {p: sc.identity(p) for p in sc.anchors()}
        errfile = os.path.join(work, f"disk{idx}.stderr")  # off the full disk
        if mounted:
            free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
            keep = rng.randrange(0, need)
            filler = os.path.join(disk, "filler")
            with open(filler, "wb") as f:
                try:
                    f.write(b"\0" * max(0, free - keep))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
            rc = run_child_wait(fn, stderr=errfile)
        else:
            filler = None
            rc = run_child_wait(fn, fsize=rng.randrange(1024, need), stderr=errfile)
        if hasattr(sc, "done"):
            sc.done(rc)
        tally.full_disk["events"] += 1
        got, expect_before, allowed = sc.check(before, allowed)
        wrote = any(v in allowed and v != expect_before.get(p) for p, v in got.items())
        wrote = rc == 0 if name.startswith("tier") else wrote  # a move leaves the same cache, elsewhere
        with open(errfile, errors="replace") as f:
            err = f.read()
        errors = [line for line in err.splitlines() if line.startswith("lynxkv: error:")]
        clean = rc == 1 and len(errors) == 1 and "Traceback" not in err  # one error line, the usual exit code
        failed = clean or name == "lmcache"  # the LMCache tier logs a failed store and reports it in its result
        kind = ("fit" if rc == 0 or name == "lmcache" else "other_rc") if wrote else \
            "failed_cleanly" if failed else "other_rc"
        tally.full_disk[kind] += 1
        if kind == "other_rc":
            tally.failures.append(f"full disk {name}: exit code {rc}, {'written' if wrote else 'nothing written'}: "
                                  f"{err.strip()[-600:]!r}")
        tally.judge(sc, got, expect_before, allowed, f"full disk {name}")
        left = leftovers(sc, ignore=[filler] if filler else [])
        if left:
            tally.left_after_writer += len(left)
            tally.failures.append(f"full disk {name} (rc {rc}): {[os.path.basename(p) for p in left]}")
    finally:
        if mounted:
            umount(disk)


def campaign(kills: int, full_disk: int, seed: int, work: str, only=None) -> dict:
    rng = random.Random(seed)
    build_command()  # every command module imported before the first fork
    assets = os.path.join(work, "assets")
    os.makedirs(assets)
    make_assets(assets)
    tally = Tally()
    names = list(only or SCENARIOS)
    scenarios = {n: SCENARIOS[n](os.path.join(work, n), assets) for n in names}
    for n, sc in scenarios.items():
        tally.durations[n] = median_duration(sc, rng)
    t0 = time.perf_counter()
    for i in range(kills):
        sc = scenarios[names[i % len(names)]]
        one(sc, rng, tally, rng.uniform(0, 1.1 * tally.durations[sc.name]))
        if i % 10 == 9:  # a writer that runs to its end: what the kills left must be gone after it
            one(sc, rng, tally, None)
    for sc in scenarios.values():
        one(sc, rng, tally, None)
    kill_s = time.perf_counter() - t0
    for i in range(full_disk):
        full_disk_event(names[i % len(names)], assets, work, rng, tally, i)
    return {"kills": tally.kills, "landed": tally.landed, "finished_before_kill": tally.completed,
            "states": tally.states, "lost": tally.lost, "mixed": tally.mixed,
            "leftovers_right_after_kill": tally.left_after_kill, "leftovers_after_next_writer": tally.left_after_writer,
            "leftover_kinds_after_kill": tally.left_kinds, "full_disk": tally.full_disk,
            "full_disk_method": "tmpfs" if MOUNTS and METHOD == "tmpfs" else "RLIMIT_FSIZE",
            "median_unkilled_s": tally.durations, "kill_phase_s": round(kill_s, 1), "failures": tally.failures}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--full-disk", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", action="append", choices=list(SCENARIOS), help="only these writers (repeatable)")
    ap.add_argument("--disk", choices=("tmpfs", "fsize"), default="tmpfs",
                    help="full disk: a small tmpfs (needs mount rights; else falls back) or RLIMIT_FSIZE")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--tmp", help="work directory (default: a fresh one under $TMPDIR, removed after)")
    args = ap.parse_args(argv)
    global METHOD
    METHOD = args.disk
    work = tempfile.mkdtemp(prefix="lynx-faults-", dir=args.tmp)
    try:
        out = campaign(args.kills, args.full_disk, args.seed, work, args.only)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    fd = out["full_disk"]
    print(f"kills tried {out['kills']} (landed mid-command {out['landed']}, command already done "
          f"{out['finished_before_kill']}) in {out['kill_phase_s']} s")
    print("states seen: " + ", ".join(f"{k} {v}" for k, v in out["states"].items()))
    print(f"caches lost {out['lost']}, mixed {out['mixed']}")
    print(f"leftovers right after a kill {out['leftovers_right_after_kill']} (removed by the next writer); "
          f"left after a writer that finished {out['leftovers_after_next_writer']}")
    print(f"full disk ({out['full_disk_method']}): {fd['events']} events, {fd['failed_cleanly']} failed with one "
          f"error, {fd['fit']} fit, {fd['other_rc']} other exit codes")
    print("median unkilled command: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in out["median_unkilled_s"].items()))
    for f in out["failures"][:20]:
        print("FAILURE", f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    bad = out["lost"] or out["mixed"] or out["leftovers_after_next_writer"] or fd["other_rc"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
