"""Running the CLI in-process from tests: its exit code and what it printed."""

from __future__ import annotations

import json

from lynxkv.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``lynxkv ARGV...``: (exit code, stdout, stderr)."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error(capsys, *argv) -> str:
    """``lynxkv ARGV...``, which must fail with exactly one ``lynxkv: error:`` line and nothing on stdout; that
    line."""
    code, out, err = run_cli(capsys, *argv)
    assert code == 1 and out == "" and "Traceback" not in err, err
    assert err.startswith("lynxkv: error:") and len(err.strip().splitlines()) == 1, err
    return err


def served_url(proc) -> str:
    """The ``url`` of the JSON document a server process started with ``--json`` prints first (``lynxkv serve``,
    ``lynxkv prefill``); its stderr if it exits before printing it."""
    lines: list[str] = []
    while not lines or lines[-1] != "}\n":
        lines.append(proc.stdout.readline())
        assert lines[-1], proc.stderr.read()
    return json.loads("".join(lines))["url"]
