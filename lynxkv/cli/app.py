"""The typer application every command module registers itself on (kept apart from ``lynxkv.cli`` so that the
command modules import it without importing each other)."""

import typer

app = typer.Typer(
    name="lynxkv",
    help="Progressive, tiered KV-cache storage and transfer: anchor first, residual later, exact output.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        from lynxkv import __version__

        typer.echo(f"lynxkv {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """Progressive, tiered KV-cache storage and transfer: anchor first, residual later, exact output."""
