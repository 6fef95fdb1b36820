"""The ``lynxkv`` command line: a thin typer layer over the library, one module per command."""

from __future__ import annotations

import errno
import os
import sys

from lynxkv.cli.app import app, build_command
from lynxkv.errors import LynxError

# Each command module registers itself on `app` when imported.
from lynxkv.cli import codec  # noqa: F401  (encode, decode, inspect, verify)
from lynxkv.cli import stream  # noqa: F401  (stream, serve, tier)
from lynxkv.cli import run  # noqa: F401  (run)
from lynxkv.cli import prefill_serve  # noqa: F401  (prefill)
from lynxkv.cli import eval as _eval  # noqa: F401  (eval)
from lynxkv.cli import demo  # noqa: F401  (demo)
from lynxkv.cli import vllm_proxy  # noqa: F401  (vllm-proxy)


class _Stdout:
    """``sys.stdout`` while a command runs: the stream it wraps (every attribute is that stream's), except that a
    write or flush that fails is remembered in :attr:`error`, so that :func:`main` tells the output's failure (a full
    disk, a reader gone from the pipe) from any other OSError. A closed stdout (``>&-``: ``sys.stdout`` is None)
    fails every write with EBADF instead of swallowing it."""

    def __init__(self, stream):
        self._stream = stream
        self.error: OSError | None = None

    def write(self, text):
        try:
            if self._stream is None:
                raise OSError(errno.EBADF, "standard output is closed")
            return self._stream.write(text)
        except OSError as exc:
            self.error = exc
            raise

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            if self._stream is not None:
                self._stream.flush()
        except OSError as exc:
            self.error = exc
            raise

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def __getattr__(self, name):
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def _output_failed(stream, exc: OSError) -> int:
    """The command's output could not be written: one line on stderr (none when the reader of a pipe has gone,
    ``lynxkv inspect ... | head``), exit status 1."""
    if stream is not None and stream is sys.__stdout__:
        # The interpreter flushes stdout once more at exit: what is still buffered would fail there again
        # ("Exception ignored ...", exit status 120). Point the descriptor at /dev/null, as the Python docs advise
        # for a broken pipe, so that the last flush has nothing to report.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, stream.fileno())
            finally:
                os.close(devnull)
        except (OSError, ValueError):
            pass
    from lynxkv.cli.console import err, escape, out

    for console in (out, err):
        # What could not be written is dropped (rich keeps a failed write's text in its buffer), not printed first by
        # the next command of this process (main called again: tests, an embedding program); and rich's
        # broken-pipe handler's "quiet" was this command's only.
        del console._buffer[:]
        console.quiet = False
    if exc.errno != errno.EPIPE:
        err.print(f"[bold red]lynxkv: error:[/] cannot write the output: {escape(exc.strerror or str(exc))}",
                  highlight=False, soft_wrap=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (typer's standalone mode handles usage errors: exit 2). A failure to
    write stdout (a full disk, a closed pipe) is one line on stderr and exit 1, never a traceback."""
    stdout, stderr = sys.stdout, sys.stderr
    guard = sys.stdout = _Stdout(stdout)
    try:
        code = _run(argv)
        if guard.error is None:
            guard.flush()  # what is still buffered fails here, not at the interpreter's exit
    except OSError:
        if guard.error is None:  # not the output's: not this handler's to explain
            raise
        code = 1
    finally:
        # (typer replaces both with flush-pacifying wrappers on a broken pipe)
        sys.stdout, sys.stderr = stdout, stderr
    if guard.error is not None:
        return _output_failed(stdout, guard.error)
    return code


def _run(argv: list[str] | None) -> int:
    try:
        build_command()(args=argv, prog_name="lynxkv")
    except LynxError as exc:
        if os.environ.get("LYNXKV_DEBUG"):
            raise
        from lynxkv.cli.console import err, escape

        err.print(f"[bold red]lynxkv: error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        return 1
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def entry() -> None:
    sys.exit(main())
