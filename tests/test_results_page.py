"""docs/results.md is generated from benchmarks/results/*.json by benchmarks/results.py: the page cannot drift from
its records, and every figure on it names the command that produces it."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _results_module():
    spec = importlib.util.spec_from_file_location("lynxkv_bench_results", ROOT / "benchmarks" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _results_module()
RECORDS = results.load_records()


def test_the_page_is_what_the_records_render():
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert page == results.render(RECORDS), "docs/results.md is out of date: run python benchmarks/results.py"


def test_there_are_records():
    assert len(RECORDS) >= 10


@pytest.mark.parametrize("name,record", RECORDS, ids=[name for name, _ in RECORDS])
def test_every_record_names_a_command_that_exists(name, record):
    argv = shlex.split(record["command"])
    assert argv[0] in ("python", "bash", "lynxkv", "make"), f"{name}: {record['command']!r} is not a command lynxkv has"
    if argv[0] in ("python", "bash"):
        assert (ROOT / argv[1]).is_file(), f"{name}: {argv[1]} does not exist"
    if argv[0] == "make":
        targets = (ROOT / "Makefile").read_text()
        assert f"\n{argv[1]}:" in targets, f"{name}: no make target {argv[1]}"


def _write(folder: pathlib.Path, record: dict) -> None:
    (folder / "r.json").write_text(json.dumps(record), encoding="utf-8")


def _good() -> dict:
    return {"title": "t", "command": "python benchmarks/bench_batch.py", "columns": ["a", "b"], "rows": [[1, 2]],
            "spread": "one run", "machine": "m", "date": "2026-12-07", "commit": "abc1234"}


@pytest.mark.parametrize("change,field", [
    (lambda r: r.pop("command"), "command"),
    (lambda r: r.update(command="  "), "command"),
    (lambda r: r.pop("spread"), "spread"),
    (lambda r: r.update(rows=[[1]]), "row 0"),
    (lambda r: r.update(date="7 Dec"), "date"),
    (lambda r: r.update(figures=[1]), "figures"),
], ids=["no-command", "blank-command", "no-spread", "short-row", "bad-date", "unknown-field"])
def test_a_record_that_cannot_be_rendered_is_refused(tmp_path, change, field):
    record = _good()
    change(record)
    _write(tmp_path, record)
    with pytest.raises(results.RecordError, match=field):
        results.load_records(tmp_path)


def test_a_record_renders_its_command_and_where_it_ran(tmp_path):
    _write(tmp_path, _good())
    text = results.render(results.load_records(tmp_path))
    assert "python benchmarks/bench_batch.py" in text
    assert "2026-12-07, commit abc1234" in text
    assert "| 1 | 2 |" in text
