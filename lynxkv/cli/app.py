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


def build_command():
    """The click command behind ``app``, with switches shown as switches in ``--help`` (typer labels every flag
    ``<bool>``, as if it took a value)."""
    command = typer.main.get_command(app)

    def clear(cmd) -> None:
        ctx = cmd.context_class(cmd, info_name=cmd.name)
        for param in [*cmd.params, cmd.get_help_option(ctx)]:
            if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        for sub in getattr(cmd, "commands", {}).values():
            clear(sub)

    clear(command)
    return command
