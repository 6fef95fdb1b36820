"""Shared rich consoles: ``out`` for data (stdout), ``err`` for messages and progress (stderr)."""

from __future__ import annotations

import json
import sys

from rich.console import Console

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)


def print_json(data) -> None:
    """Machine-readable output: plain JSON on stdout, one document, no colour."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()
