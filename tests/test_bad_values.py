"""Bad values a user can give: each is one ``lynxkv: error:`` line and exit 1, never a traceback. A directory or
a name with a NUL byte where a cache file goes; a rate, latency or size that is infinite, NaN or absurd; a
temperature too small to sample from or infinite; a seed past 64 bits; a stdout that cannot be written."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch

from cli_helpers import one_error as _one_error, run_cli as _run
from lynxkv.cli import main
from lynxkv.errors import InputError


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tiny_cache(path) -> str:
    from lynxkv.cache.save import save_cache

    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(2, 40, 8, generator=g), torch.randn(2, 40, 8, generator=g)) for _ in range(2)]
    save_cache(str(path), kv)
    return str(path)


# --- cache paths: a directory, a NUL byte -------------------------------------------------------------------


def test_inspect_of_a_directory_is_one_error_and_leaks_no_descriptor(tmp_path, capsys):
    d = tmp_path / "somedir"
    d.mkdir()
    _one_error(capsys, "inspect", d)  # warm: imports may open files of their own
    before = _open_fds()
    for _ in range(5):
        err = _one_error(capsys, "inspect", d)
        assert f"{d} is a directory, not a cache file" in err
    assert _open_fds() == before


def test_inspect_of_a_name_with_a_nul_byte_is_one_error(tmp_path, capsys):
    err = _one_error(capsys, "inspect", str(tmp_path / "c0.lynx") + "\x00x")
    assert "c0.lynx\\x00x: a path may not contain a NUL byte" in err
    assert "\x00" not in err  # never sent to a terminal as it is


def test_storage_openers_refuse_a_nul_byte_and_a_directory(tmp_path):
    from lynxkv.storage import FileSource, read_range, size_of, write_atomic, writer_lock

    nul = str(tmp_path / "c.lynx\x00x")
    for call in (lambda: FileSource(nul), lambda: read_range(nul, 0, 1), lambda: size_of(nul),
                 lambda: write_atomic(nul, b"x")):
        with pytest.raises(InputError, match="a path may not contain a NUL byte"):
            call()
    with pytest.raises(InputError, match="a path may not contain a NUL byte"):
        with writer_lock(nul):
            pass
    d = tmp_path / "d"
    d.mkdir()
    with pytest.raises(InputError, match="is a directory, not a cache file"):
        FileSource(str(d))
    with pytest.raises(InputError, match="is a directory"):
        read_range(str(d), 0, 1)
    with pytest.raises(InputError, match="is a directory; cannot write a file in its place"):
        write_atomic(str(d), b"x")
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(d) == []  # no temporary left behind


def test_encode_over_a_directory_writes_nothing(tmp_path, capsys):
    from safetensors.torch import save_file

    src = tmp_path / "kv.safetensors"
    save_file({f"layers.0.{k}": torch.randn(2, 40, 8) for k in ("key", "value")}, src)
    d = tmp_path / "out"
    d.mkdir()
    err = _one_error(capsys, "encode", src, "-o", d, "--force")
    assert "is a directory" in err
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors", "out"] and os.listdir(d) == []


# --- rates, durations, sizes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value, message", [
    ("1e400Mbps", "too large"), ("8001Tbps", "too large"), (float("inf"), "too large"), (float("nan"), "not a number"),
    (10**400, "too large"), (2e15, "too large"), ("1e-300bps", "too small"), ("0.5bps", "too small"),
    (float("-inf"), "must be positive"),
], ids=lambda v: repr(v)[:24])
def test_bandwidth_must_be_finite_and_sane(value, message):
    from lynxkv.stream.units import parse_bandwidth

    with pytest.raises(InputError, match=f"bandwidth.*{message}"):
        parse_bandwidth(value)


def test_bandwidth_bounds_are_accepted():
    from lynxkv.stream.units import parse_bandwidth

    assert parse_bandwidth("8000Tbps") == 1e15 and parse_bandwidth(1e15) == 1e15
    assert parse_bandwidth("1bps") == 0.125


@pytest.mark.parametrize("value, message", [
    ("1e300s", "too long"), ("1e400", "too long"), (float("inf"), "too long"), (float("nan"), "not a number"),
    (10**400, "too large"), (1.0000001e9, "too long"), (float("-inf"), "must not be negative"),
], ids=lambda v: repr(v)[:24])
def test_duration_must_be_finite_and_sane(value, message):
    from lynxkv.stream.units import parse_duration

    with pytest.raises(InputError, match=f"duration.*{message}"):
        parse_duration(value)


def test_duration_bound_is_accepted():
    from lynxkv.stream.units import parse_duration

    assert parse_duration("1e9s") == 1e9 and parse_duration(1e9) == 1e9 and parse_duration("1000000ms") == 1000.0


@pytest.mark.parametrize("value, message", [
    ("1e400", "too large"), ("1025TiB", "too large"), (10**400, "too large"), (2**50 + 1, "too large"),
    ("0.5", "at least 1 byte"), ("0", "at least 1 byte"),
], ids=lambda v: repr(v)[:24])
def test_size_must_be_finite_and_sane(value, message):
    from lynxkv.stream.units import parse_size

    with pytest.raises(InputError, match=f"size.*{message}"):
        parse_size(value)
    assert parse_size("1024TiB") == 2**50 and parse_size("1") == 1


@pytest.mark.parametrize("argv", [["--bandwidth", "1e400Mbps"], ["--latency", "1e300s"],
                                  ["--bandwidth", "1e-300bps"]])
def test_stream_with_an_absurd_link_is_one_error(tmp_path, capsys, argv):
    cache = _tiny_cache(tmp_path / "c.lynx")
    err = _one_error(capsys, "stream", cache, *argv)
    assert repr(argv[1]) in err


# --- sampling parameters and seeds ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature, message", [
    (float("inf"), "must be finite"), (1e-40, "too small to sample from.*use 0 for greedy decoding"),
    (9.9e-6, "too small"), (5e-324, "too small"), (float("nan"), ">= 0"), (-1.0, ">= 0"),
], ids=lambda v: repr(v)[:24])
def test_temperature_must_be_finite_and_not_tiny(temperature, message):
    from lynxkv.speculative.sampling import SamplingParams

    with pytest.raises(InputError, match=message):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [float("nan"), float("inf"), float("-inf"), 0.0, 1.5])
def test_top_p_must_be_in_range(top_p):
    from lynxkv.speculative.sampling import SamplingParams

    with pytest.raises(InputError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=top_p)


def test_smallest_temperature_samples_real_logits():
    """1e-5 (the smallest) samples without error; like greedy on real logits, never NaN even with logits of
    +-1e4 in any dtype, whatever the top-p."""
    from lynxkv.speculative.sampling import MIN_TEMPERATURE, SamplingParams, choose, logits_to_probs

    assert MIN_TEMPERATURE == 1e-5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50_000, generator=g) * 10
    for _ in range(20):
        token, probs = choose(logits, SamplingParams(temperature=1e-5), g)
        assert token == int(logits.argmax()) and torch.isfinite(probs).all()
    for i in range(60):
        scale = 10 ** (i % 7 - 2)  # 0.01 .. 1e4
        x = (torch.rand(2, 3000, generator=g) * 2 - 1) * scale
        x[:, 0], x[:, 1] = 1e4, -1e4
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for t in (1e-5, 1e-3, 1.0, 1e6):
                for top_p in (1.0, 0.9, 1e-6):
                    p = logits_to_probs(x.to(dtype), SamplingParams(temperature=t, top_p=top_p))
                    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(2), atol=1e-3)


@pytest.mark.parametrize("seed", [2**64, 99999999999999999999999, -2**63 - 1, 1.5, True, "7"],
                         ids=lambda v: repr(v)[:24])
def test_seed_must_fit_64_bits(seed):
    from lynxkv.speculative import RunConfig

    with pytest.raises(InputError, match="seed must be an integer that fits 64 bits"):
        RunConfig(seed=seed)


def test_seed_bounds_are_accepted():
    from lynxkv.speculative import RunConfig

    for seed in (None, 0, 2**63 - 1, 2**64 - 1, -2**63, -1, np.int64(7)):
        cfg = RunConfig(seed=seed)
        if seed is not None:
            assert type(cfg.seed) is int
            torch.Generator().manual_seed(cfg.seed)  # what the runner does with it


@pytest.mark.parametrize("argv, message", [
    (["--seed", "99999999999999999999999", "--temperature", "0.7"], "seed must be an integer"),
    (["--temperature", "1e-40"], "too small to sample from"),
    (["--temperature", "inf"], "must be finite"),
])
def test_run_with_a_bad_seed_or_temperature_is_one_error(tmp_path, capsys, monkeypatch, argv, message):
    from runner_helpers import single_thread, tiny_llama_cache
    from lynxkv.hf import models

    with contextlib.contextmanager(single_thread)():
        _, model_dir, path, _, _ = tiny_llama_cache(tmp_path, tokens=40)
        capsys.readouterr()  # (saving the model reports its progress)

        def no_loading(*args, **kwargs):
            raise AssertionError("the model was loaded before the settings were checked")

        monkeypatch.setattr(models, "load_model", no_loading)
        err = _one_error(capsys, "run", path, "--model", model_dir, "-n", "4", *argv)
    assert message in err
    # several caches at once (a batch): the same check, before any cache is opened
    err = _one_error(capsys, "run", tmp_path / "a.lynx", tmp_path / "b.lynx", *argv)
    assert message in err


# --- a stdout that cannot be written -------------------------------------------------------------------------


class _FailingStdout:
    """A stdout whose every write fails as a full disk (or a closed pipe) fails."""

    encoding = "utf-8"

    def __init__(self, error: int):
        self.errno = error
        self.writes = 0

    def write(self, text):
        self.writes += 1
        raise OSError(self.errno, os.strerror(self.errno))

    def flush(self):
        pass

    def isatty(self):
        return False


@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "table"])
def test_a_full_stdout_is_one_error(tmp_path, capsys, monkeypatch, json_flag):
    import errno
    import sys

    cache = _tiny_cache(tmp_path / "c.lynx")
    capsys.readouterr()
    failing = _FailingStdout(errno.ENOSPC)
    monkeypatch.setattr(sys, "stdout", failing)
    code = main(["inspect", cache, *json_flag])
    assert sys.stdout is failing  # put back as it was
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 1 and failing.writes >= 1
    assert err == "lynxkv: error: cannot write the output: No space left on device\n"


def test_a_broken_pipe_ends_quietly(tmp_path, capsys, monkeypatch):
    import errno
    import sys

    cache = _tiny_cache(tmp_path / "c.lynx")
    capsys.readouterr()
    failing = _FailingStdout(errno.EPIPE)
    stderr = sys.stderr
    monkeypatch.setattr(sys, "stdout", failing)
    code = main(["inspect", cache, "--json"])
    assert sys.stdout is failing and sys.stderr is stderr  # typer's pacifying wrappers do not outlive the call
    monkeypatch.undo()
    assert code == 1 and capsys.readouterr().err == ""


def test_other_errors_are_not_taken_for_the_output(tmp_path, capsys):
    """An error that is not the output's keeps its own message, even if stdout is fine."""
    err = _one_error(capsys, "inspect", tmp_path / "missing.lynx")
    assert "cannot write the output" not in err and "missing.lynx" in err


def test_the_cli_process_with_a_full_or_closed_stdout(tmp_path):
    """The real process: /dev/full and a closed stdout are one line and exit 1; a reader gone from the pipe
    is exit 1 and nothing at all (no "Exception ignored" at the interpreter's exit)."""
    import subprocess
    import sys

    cache = _tiny_cache(tmp_path / "c.lynx")
    cmd = [sys.executable, "-m", "lynxkv", "inspect", cache]
    for extra in (["--json"], []):
        if os.path.exists("/dev/full"):
            with open("/dev/full", "w") as full:
                p = subprocess.run(cmd + extra, stdout=full, stderr=subprocess.PIPE, text=True)
            assert (p.returncode, p.stderr) == (1, "lynxkv: error: cannot write the output: No space left on "
                                                   "device\n")
        p = subprocess.run(cmd + extra, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           preexec_fn=lambda: os.close(1))
        assert (p.returncode, p.stderr) == (1, "lynxkv: error: cannot write the output: standard output is "
                                               "closed\n")
        r, w = os.pipe()
        os.close(r)
        try:
            p = subprocess.run(cmd + extra, stdout=w, stderr=subprocess.PIPE, text=True)
        finally:
            os.close(w)
        assert (p.returncode, p.stderr) == (1, "")


def test_text_inputs_read_newlines_as_text_mode_does(tmp_path):
    """A prompt file written on Windows (\\r\\n) or old Macs (\\r) reads as the same text as with \\n: the prompt's
    tokens, and so a cached prompt's continuation, do not depend on the system that wrote the file."""
    from lynxkv.cli.console import read_text

    for ending in ("\r\n", "\r", "\n"):
        p = tmp_path / "p.txt"
        p.write_bytes(("\ufeff" if ending == "\r" else "").encode() + ending.join(["one", "two", ""]).encode())
        assert read_text(p) == "one\ntwo\n"
