"""Shared rich consoles and the CLI's conventions for output.

- ``out`` for data (stdout), ``err`` for messages and progress (stderr); ``--json`` output goes through
  :func:`print_json`.
- On a terminal tables fit its width; anywhere else (a file, a pipe) they are rendered at their full natural
  width, so no number is ever cut to ``1.4…``.
- Text that comes from outside (an error message, a path, a tensor name) is printed with :func:`escape`, so
  ``[kv_heads, tokens, head_dim]`` is not taken for rich markup.
- Long steps show a progress line with the elapsed time (:func:`progress_step`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from rich.console import Console, ConsoleDimensions
from rich.markup import escape

from lynxkv.errors import InputError

__all__ = ["err", "escape", "model_label", "out", "parse_dtype", "print_json", "progress_step", "read_text"]

_UNLIMITED = 1 << 16  # columns for output that is not a terminal: as wide as the content needs


class _Console(Console):
    # rich renders with ``size`` (its ``width`` reads it), which falls back to 80 columns off a terminal
    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(_UNLIMITED, size.height)
        return size

    @size.setter
    def size(self, value: tuple[int, int]) -> None:
        Console.size.fset(self, value)


out = _Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


def print_json(data) -> None:
    """Machine-readable output: plain JSON on stdout, one document, no colour."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def progress_step(description: str):
    """A progress line on stderr for one long step (a spinner, the step and its elapsed time), removed when the
    step ends; nothing when stderr is not a terminal (a log keeps only results and errors)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if not err.is_terminal:
        yield
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        bar.add_task(escape(description), total=None)
        yield


#: The most a text input (a prompt file, a request file) may hold: far more than any prompt, and a bound on what
#: a file that never ends (``/dev/zero``) can make lynxkv read.
TEXT_LIMIT = 64 << 20


def read_text(path: str | os.PathLike, limit: int | None = None) -> str:
    """A text file's contents (a UTF-8 byte-order mark dropped), or one clear error (missing, a directory, over
    ``limit`` bytes (default :data:`TEXT_LIMIT`), not UTF-8)."""
    limit = TEXT_LIMIT if limit is None else limit
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a text file") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise InputError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if len(data) > limit:
        raise InputError(f"{path}: more than {limit:,} bytes; not a text input lynxkv reads")
    try:  # newlines as text mode reads them: \r\n and \r are \n (a prompt must read the same on every system)
        return data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def parse_dtype(name: str, *, auto: bool = False):
    """The torch dtype a ``--dtype`` names (fp32, fp16 or bf16; ``"auto"`` itself where ``auto`` allows it: the
    model's own dtype), or one clear error."""
    from lynxkv.cache.kv import TORCH_DTYPES

    if auto and name == "auto":
        return name
    if name not in TORCH_DTYPES:
        choices = ["auto", *TORCH_DTYPES] if auto else list(TORCH_DTYPES)
        raise InputError(f"--dtype: expected one of {', '.join(choices)}, got {name!r}")
    return TORCH_DTYPES[name]


def model_label(model: str | None) -> str:
    """How a progress line names the model ``--model`` chose (``None``: the offline default)."""
    return model or "SmolLM2-135M-Instruct (offline default)"
