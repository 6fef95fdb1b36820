"""Render docs/results.md, the one page of measured figures, from the records in benchmarks/results/*.json.

    python benchmarks/results.py            # rewrite docs/results.md
    python benchmarks/results.py --check    # exit 1 if docs/results.md is not what the records render

Each record is one group of figures, measured by one command: a JSON object with

- ``title``: what was measured (a heading of the page);
- ``command``: the command that produces the figures with today's code (a benchmark script or a ``lynxkv``
  command); ``as_run`` (optional): the command as it was run, where it named options that have gone since;
- ``columns`` and ``rows``: the table, every row as many cells as there are columns (strings or numbers);
- ``spread``: how the spread of the figures is given (min–max of the runs, ± s.e.m., or why there is none);
- ``machine``, ``date`` (YYYY-MM-DD) and ``commit``: where and on what code the command ran;
- ``about`` (optional): one paragraph on the set-up; ``notes`` (optional): a list of short findings;
- ``page`` (optional): the docs page (file name under docs/) that refers to the group.

Records are rendered in the order of their file names; the output depends on nothing but the records, so the
page cannot drift from them (tests/test_results_page.py checks it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"

REQUIRED = ("title", "command", "columns", "rows", "spread", "machine", "date", "commit")
OPTIONAL = ("as_run", "about", "notes", "page")

HEADER = """# Results

Every measured figure lynxkv's documentation relies on, each group with the command that produces it, the
machine, the date and the commit it ran on. The other pages say what the code does and link here for numbers.

This page is generated: edit the records in `benchmarks/results/*.json` and run `python benchmarks/results.py`
(`tests/test_results_page.py` fails when the page and the records disagree). A figure measured again replaces
its record; git keeps the earlier ones. Figures measured while the runner still had options that are now its
fixed behaviour give, under "As run then", the command as it was run. Records measured before the `.lynx` format
was fixed at 1.0 name a scheme by the development version whose default it was (1.0: α = 1, values per token;
1.2: α = 1, values per channel, 4 sink tokens; 1.3: keys rotated, α = 0.5, extremes at the sub-bins' midpoints;
1.6: today's default); those versions were never released, and format 1.0 holds every scheme.

Terms used in the tables: Δ = min(t_res, 64·TPOT), where t_res is the residual's arrival after the anchor and
TPOT a plain decode step: the most that drafting while the residual arrives can save on the time to 64 tokens.
The gain is the monolithic full code's TT64 minus Lynx's. "Full" is the monolithic full code (load everything,
then decode), "anchor" the anchor alone (lossy). TT-N is the time to the N-th committed token.
"""


class RecordError(ValueError):
    """A record that cannot be rendered: names the file and the field."""


def load_records(folder: Path = RECORDS) -> list[tuple[str, dict]]:
    """Every record of ``folder`` as (file name, record), in file-name order, each checked."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise RecordError(f"{path.name}: not JSON ({e})") from None
        check_record(path.name, record)
        records.append((path.name, record))
    return records


def check_record(name: str, record: object) -> None:
    """Refuse a record that lacks a field, has one it does not know, or a table whose rows do not fit."""
    if not isinstance(record, dict):
        raise RecordError(f"{name}: expected a JSON object, got {type(record).__name__}")
    for key in REQUIRED:
        if key not in record:
            raise RecordError(f"{name}: missing field {key!r}")
    unknown = sorted(set(record) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise RecordError(f"{name}: unknown field(s) {', '.join(unknown)}")
    for key in ("title", "command", "spread", "machine", "commit"):
        if not isinstance(record[key], str) or not record[key].strip():
            raise RecordError(f"{name}: {key!r} must be a non-empty string")
    for key in ("as_run", "about", "page"):
        if key in record and (not isinstance(record[key], str) or not record[key].strip()):
            raise RecordError(f"{name}: {key!r} must be a non-empty string when given")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(record["date"])):
        raise RecordError(f"{name}: 'date' must be YYYY-MM-DD, got {record['date']!r}")
    columns, rows = record["columns"], record["rows"]
    if not isinstance(columns, list) or not columns:
        raise RecordError(f"{name}: 'columns' must be a non-empty list")
    if not isinstance(rows, list) or not rows:
        raise RecordError(f"{name}: 'rows' must be a non-empty list")
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            raise RecordError(f"{name}: row {i} must be a list of {len(columns)} cells")
    notes = record.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise RecordError(f"{name}: 'notes' must be a list of strings")


def anchor(title: str) -> str:
    """The GitHub-style anchor of a heading, so that other pages can link to a group."""
    slug = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return slug.replace(" ", "-")


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_record(record: dict) -> str:
    lines = [f"## {record['title']}", ""]
    if record.get("about"):
        lines += [record["about"], ""]
    lines += ["```sh", record["command"], "```", ""]
    if record.get("as_run"):
        lines += [f"As run then: {record['as_run']}", ""]
    spread = record["spread"].rstrip(".")
    lines.append(f"Ran on {record['machine']}, {record['date']}, commit {record['commit']}. Spread: {spread}.")
    lines.append("")
    columns = record["columns"]
    lines.append("| " + " | ".join(_cell(c) for c in columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in record["rows"]:
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    if record.get("notes"):
        lines.append("")
        lines += [f"- {note}" for note in record["notes"]]
    if record.get("page"):
        page = record["page"]
        lines += ["", f"What the code does: [{page.removeprefix('../')}]({page})."]
    return "\n".join(lines) + "\n"


def render(records: list[tuple[str, dict]]) -> str:
    """The whole page: the header, a contents list, then one section per record."""
    parts = [HEADER, "## Contents", ""]
    parts += [f"- [{r['title']}](#{anchor(r['title'])})" for _, r in records]
    text = "\n".join(parts) + "\n"
    for _, record in records:
        text += "\n" + render_record(record)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write: exit 1 if the page is out of date")
    args = ap.parse_args(argv)
    try:
        records = load_records()
    except RecordError as e:
        print(f"results: error: {e}", file=sys.stderr)
        return 1
    text = render(records)
    if args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"results: {PAGE.relative_to(ROOT)} is out of date: run python benchmarks/results.py",
                  file=sys.stderr)
            return 1
        return 0
    tmp = PAGE.with_suffix(".md.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(PAGE)  # never a half-written page under the real name
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(records)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
