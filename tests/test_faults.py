"""Faults on purpose: what a killed writer or a full disk leaves, and the fault campaign at a small size
(``benchmarks/fault_campaign.py``; docs/faults.md has the full run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lynxkv.cache import open_cache, save_cache, verify_file
from lynxkv.cli import main
from lynxkv.errors import InputError
from lynxkv.quant.scheme import Scheme

ROOT = Path(__file__).resolve().parents[1]
SCHEME = Scheme(chunk=4, page=8)


def kv(seed: int = 0, tokens: int = 20):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, tokens, 4, generator=g), torch.randn(2, tokens, 4, generator=g)) for _ in range(2)]


def names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def killed_at(point: int, fn) -> None:
    """Run ``fn`` in a forked child that SIGKILLs itself at its ``point``-th atomic commit (0: at the first removal
    of a replaced residual, after both commits), as a crash or ``kill -9`` would stop it."""
    import signal

    from lynxkv.storage import AtomicWriter

    pid = os.fork()
    if pid == 0:
        try:
            import lynxkv.cache.save as save_mod
            import lynxkv.stream.received as received_mod

            real_commit, real_remove, calls = AtomicWriter.commit, save_mod.remove, []

            def commit(self):
                calls.append(self.url)
                if len(calls) == point:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_commit(self)

            def remove(url):
                if point == 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_remove(url)

            AtomicWriter.commit = commit
            save_mod.remove = received_mod.remove = remove
            fn()
        finally:
            os._exit(3)  # not killed: the point was never reached
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"point {point} never reached"


def whole_cache_files(d: Path, anchor: str) -> set[str]:
    """The anchor and the residual it names (the cache must verify)."""
    p = d / anchor
    assert verify_file(p) == [], f"{anchor} is not whole: {names(d)}"
    with open_cache(p) as cache:
        loc = cache.info.residual_location
    return {anchor} | ({Path(loc).name} if loc else set())


@pytest.mark.parametrize("point", [1, 2, 0], ids=["before-residual-commit", "before-anchor-commit",
                                                   "before-old-residual-removal"])
def test_the_writer_after_a_killed_replacement_leaves_only_the_new_cache(tmp_path, point):
    # The replacement writes its residual under a fresh name (c.<8 hex>.lynxr); the next writer, another fresh
    # name, removes the killed one's temporaries, its residual and the lock file, whatever the point.
    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    save_cache(tmp_path / "c.lynx", kv(2), SCHEME)  # the cache in place keeps its residual under a fresh name
    killed_at(point, lambda: save_cache(tmp_path / "c.lynx", kv(3), SCHEME))
    assert verify_file(tmp_path / "c.lynx") == []  # the old cache or the new one, whole
    assert len(names(tmp_path)) > 2  # the kill left something behind
    save_cache(tmp_path / "c.lynx", kv(4), SCHEME)
    assert names(tmp_path) == sorted(whole_cache_files(tmp_path, "c.lynx"))


@pytest.mark.parametrize("point", [1, 2, 0], ids=["before-residual-commit", "before-anchor-commit",
                                                   "before-old-residual-removal"])
def test_the_stream_copy_after_a_killed_one_leaves_only_the_new_copy(tmp_path, point):
    # lynxkv stream -o --force over a saved copy: its residual goes to a fresh name from the streamed cache's id,
    # so the next copy of another cache uses another name; what the killed copy left must still go.
    for which, seed in (("a", 1), ("b", 2), ("c", 3)):
        (tmp_path / which).mkdir()
        save_cache(tmp_path / which / "c.lynx", kv(seed), SCHEME)
    dl = tmp_path / "dl"
    assert main(["stream", str(tmp_path / "a" / "c.lynx"), "-o", str(dl / "c.lynx")]) == 0
    killed_at(point, lambda: main(["stream", str(tmp_path / "b" / "c.lynx"), "-o", str(dl / "c.lynx"), "--force"]))
    assert verify_file(dl / "c.lynx") == []
    assert len(names(dl)) > 2
    assert main(["stream", str(tmp_path / "c" / "c.lynx"), "-o", str(dl / "c.lynx"), "--force"]) == 0
    assert names(dl) == sorted(whole_cache_files(dl, "c.lynx"))
    with open_cache(dl / "c.lynx") as got, open_cache(tmp_path / "c" / "c.lynx") as want:
        assert got.info.cache_id == want.info.cache_id


def test_neighbours_of_a_cache_survive_its_replacements_and_killed_writers(tmp_path):
    # x.1a2b3c4d.lynx and its residual x.1a2b3c4d.lynxr look like a fresh residual name of x.lynx; d.lynx (a
    # tier move of an earlier x.lynx) names x.lynxr itself; a dead writer's temporary of the neighbour is its own
    # writers' business. Replacing x.lynx, and the writer after a killed replacement, touch none of them.
    neighbour = tmp_path / "x.1a2b3c4d.lynx"
    save_cache(neighbour, kv(1), SCHEME)
    save_cache(tmp_path / "x.lynx", kv(2), SCHEME)
    assert main(["tier", str(tmp_path / "x.lynx"), str(tmp_path / "d.lynx")]) == 0  # d.lynx names x.lynxr
    temp = tmp_path / ".x.1a2b3c4d.lynxr.999999999-0badcafe.tmp"
    temp.write_bytes(b"half")
    user = tmp_path / "x.0badcafe.lynxr.notes"
    user.write_bytes(b"a user's file")
    before = {n: (tmp_path / n).read_bytes() for n in names(tmp_path)}
    for seed in (3, 4):
        save_cache(tmp_path / "x.lynx", kv(seed), SCHEME)
    killed_at(2, lambda: save_cache(tmp_path / "x.lynx", kv(5), SCHEME))
    save_cache(tmp_path / "x.lynx", kv(6), SCHEME)
    assert main(["stream", str(neighbour), "-o", str(tmp_path / "x.lynx"), "--force"]) == 0
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert verify_file(neighbour) == [] and verify_file(tmp_path / "d.lynx") == []
    assert set(names(tmp_path)) == set(before) | whole_cache_files(tmp_path, "x.lynx")


def test_a_tier_move_after_a_killed_replacement_keeps_the_residual_its_anchor_names(tmp_path):
    # Killed after the new anchor was renamed into place, before the old residual went: the journal names both
    # residuals. tier moves the anchor away (to d.lynx, still naming the new residual); it settles the journal
    # first, so the next writer of x.lynx finds nothing to remove that d.lynx needs.
    save_cache(tmp_path / "x.lynx", kv(1), SCHEME)
    save_cache(tmp_path / "x.lynx", kv(2), SCHEME)
    killed_at(0, lambda: save_cache(tmp_path / "x.lynx", kv(3), SCHEME))
    assert main(["tier", str(tmp_path / "x.lynx"), str(tmp_path / "d.lynx")]) == 0
    save_cache(tmp_path / "x.lynx", kv(4), SCHEME)
    assert verify_file(tmp_path / "d.lynx") == [] and verify_file(tmp_path / "x.lynx") == []
    assert names(tmp_path) == sorted(whole_cache_files(tmp_path, "d.lynx") | whole_cache_files(tmp_path, "x.lynx"))


def test_tier_on_a_full_disk_removes_the_residual_copy_no_anchor_names(tmp_path, monkeypatch, capsys):
    import lynxkv.stream.tier as tier

    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    before = {n: (tmp_path / n).read_bytes() for n in names(tmp_path)}
    real = tier.write_atomic

    def full_for_anchors(url, data, **kw):
        if str(url).endswith(".lynx"):
            raise InputError(f"{url}: no space left on the device; nothing was written")
        return real(url, data, **kw)

    monkeypatch.setattr(tier, "write_atomic", full_for_anchors)
    code = main(["tier", str(tmp_path / "c.lynx"), "--residual-out", str(tmp_path / "far" / "c.lynxr")])
    assert code == 1 and "no space left" in capsys.readouterr().err
    assert names(tmp_path / "far") == []  # the copy that was published first is gone again
    assert {n: (tmp_path / n).read_bytes() for n in names(tmp_path) if n != "far"} == before
    assert verify_file(tmp_path / "c.lynx") == []


def test_stream_copy_on_a_full_disk_leaves_no_residual_behind(tmp_path, monkeypatch, capsys):
    from lynxkv.storage import AtomicWriter

    save_cache(tmp_path / "c.lynx", kv(1), SCHEME)
    real, calls = AtomicWriter.commit, []

    def commit(self):
        calls.append(self.url)
        if len(calls) == 2:  # the anchor, after the residual was published
            self.abort()
            raise InputError(f"{self.url}: no space left on the device; nothing was written")
        return real(self)

    monkeypatch.setattr(AtomicWriter, "commit", commit)
    code = main(["stream", str(tmp_path / "c.lynx"), "-o", str(tmp_path / "dl" / "c.lynx")])
    assert code == 1 and "no space left" in capsys.readouterr().err
    assert calls[0].endswith(".lynxr") and names(tmp_path / "dl") == []


class SmallDisk:
    """A disk with ``free`` bytes left, for lynxkv's writers: their files' writes and the writer lock's notes
    fail with ENOSPC once the bytes are spent, part-way through a write as on a real disk."""

    def __init__(self, monkeypatch, free: int):
        import errno

        import lynxkv.storage.atomic as atomic
        import lynxkv.storage.lock as lock

        self.free = free
        real_fdopen, real_write = os.fdopen, os.write
        disk = self

        def spend(n: int) -> int:
            if disk.free <= 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            n = min(n, disk.free)
            disk.free -= n
            return n

        class File:
            def __init__(self, f):
                self._f = f

            def write(self, data):
                view = memoryview(data).cast("B")
                done = 0
                while done < len(view):
                    n = spend(len(view) - done)
                    self._f.write(view[done:done + n])
                    done += n
                return done

            def __getattr__(self, name):
                return getattr(self._f, name)

        def write(fd, data):
            return real_write(fd, memoryview(data).cast("B")[:spend(len(data))])

        monkeypatch.setattr(atomic.os, "fdopen", lambda fd, mode="r", *a, **k: File(real_fdopen(fd, mode, *a, **k)))
        monkeypatch.setattr(lock.os, "write", write)


def test_stream_copy_on_a_full_disk_fails_with_one_error_line_and_leaves_the_old_copy(tmp_path, monkeypatch,
                                                                                        capsys):
    # lynxkv stream -o --force over a saved copy, on a disk that fills at every point of the write (the lock's
    # note, the residual, the anchor): one "lynxkv: error:" line, exit 1, the old copy byte for byte and nothing
    # else; or, where it fits, the new copy and nothing else.
    for which, seed in (("a", 1), ("b", 2)):
        (tmp_path / which).mkdir()
        save_cache(tmp_path / which / "c.lynx", kv(seed), SCHEME)
    dl = tmp_path / "dl"
    assert main(["stream", str(tmp_path / "a" / "c.lynx"), "-o", str(dl / "c.lynx")]) == 0
    before = {n: (dl / n).read_bytes() for n in names(dl)}
    need = sum(len(b) for b in before.values())
    outcomes = set()
    for free in [0, 40, 100, 200, 300, 500] + list(range(600, need + 800, 150)):
        capsys.readouterr()
        with monkeypatch.context() as m:
            SmallDisk(m, free)
            code = main(["stream", str(tmp_path / "b" / "c.lynx"), "-o", str(dl / "c.lynx"), "--force"])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("lynxkv: error:")]
        if code == 0:
            outcomes.add("fit")
            assert names(dl) == sorted(whole_cache_files(dl, "c.lynx")), free
            break
        outcomes.add("full")
        assert code == 1 and len(errors) == 1 and "no space left" in errors[0] and "Traceback" not in err, (free, err)
        assert {n: (dl / n).read_bytes() for n in names(dl)} == before, free
    assert outcomes == {"full", "fit"}


@pytest.mark.slow
def test_fault_campaign_small(tmp_path):
    """40 random SIGKILLs across encode, tier, stream -o and the LMCache tier's store, and 8 full disks: every
    cache path old or new and whole, nothing left after the next writer."""
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "benchmarks/fault_campaign.py", "--kills", "40", "--full-disk", "8",
                           "--json", str(out), "--tmp", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["failures"] == [] and proc.returncode == 0, proc.stdout[-3000:]
    assert got["kills"] == 40 and got["landed"] > 10  # most kills land while the command runs
    assert got["lost"] == 0 and got["mixed"] == 0 and got["leftovers_after_next_writer"] == 0
    assert got["states"]["old"] > 0 and got["states"]["new"] > 0
    assert got["full_disk"]["events"] == 8 and got["full_disk"]["failed_cleanly"] > 0
    assert got["full_disk"]["other_rc"] == 0
