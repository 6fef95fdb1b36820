"""The ``lynxkv`` command line: a thin typer layer over the library, one module per command."""

from __future__ import annotations

import os
import sys

from lynxkv.cli.app import app, build_command
from lynxkv.errors import LynxError

# Each command module registers itself on `app` when imported.
from lynxkv.cli import codec  # noqa: F401  (encode, decode, inspect, verify)
from lynxkv.cli import stream  # noqa: F401  (stream, serve, tier)
from lynxkv.cli import run  # noqa: F401  (run)
from lynxkv.cli import eval as _eval  # noqa: F401  (eval)
from lynxkv.cli import demo  # noqa: F401  (demo)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code (typer's standalone mode handles usage errors: exit 2)."""
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
