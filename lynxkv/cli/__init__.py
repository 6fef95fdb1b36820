"""The ``lynxkv`` command line: a thin typer layer over the library, one module per command.

Data goes to stdout, messages and progress to stderr. A :class:`~lynxkv.errors.LynxError` becomes one line
``lynxkv: error: ...`` and exit code 1 (``LYNXKV_DEBUG=1`` shows the traceback instead).
"""

from __future__ import annotations

import os
import sys

import typer

from lynxkv.errors import LynxError

app = typer.Typer(
    name="lynxkv",
    help="Progressive, tiered KV-cache storage and transfer: anchor first, residual later, exact output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Each command module registers itself on `app` when imported.
from lynxkv.cli import codec  # noqa: E402,F401  (encode, decode, inspect, verify)
from lynxkv.cli import stream  # noqa: E402,F401  (stream, serve, tier)
from lynxkv.cli import run  # noqa: E402,F401  (run)


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point."""
    try:
        app(args=argv, standalone_mode=False)
    except LynxError as exc:
        if os.environ.get("LYNXKV_DEBUG"):
            raise
        from lynxkv.cli.console import err

        err.print(f"[bold red]lynxkv: error:[/] {exc}", highlight=False)
        return 1
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:  # typer/click exit codes (usage errors are 2)
        return int(exc.code or 0)
    except Exception as exc:  # click's own usage errors arrive here in non-standalone mode
        import click

        if isinstance(exc, click.exceptions.ClickException):
            exc.show()
            return exc.exit_code
        if isinstance(exc, click.exceptions.Abort):
            return 1
        raise
    return 0


def entry() -> None:
    sys.exit(main())
