"""The README is the front door: short, every command in it a real one, every link resolving, its Python example
running as written."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img [^>]*src="([^"]+)"', text)
    local = [link.split("#")[0] for link in links if "://" not in link and not link.startswith(("#", "mailto:"))]
    missing = [link for link in local if link and not (page.parent / link).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"


def _readme_commands() -> list[list[str]]:
    lines = [line.split("  #")[0].strip() for block in _blocks(README, "sh") for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


def test_readme_set_up_commands_are_make_targets():
    targets = re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M)
    make = [argv for argv in _readme_commands() if argv[0] == "make"]
    assert [argv[1] for argv in make[:2]] == ["demo", "test"]
    assert all(argv[1] in targets for argv in make)


@pytest.mark.parametrize("argv", [a for a in _readme_commands() if a[0] == "lynxkv"], ids=lambda a: " ".join(a[:2]))
def test_every_readme_command_parses_against_the_real_cli(argv):
    """Each ``lynxkv ...`` line names a real command whose options and values the CLI accepts as written."""
    from lynxkv.cli.app import build_command

    commands = build_command().commands
    assert argv[1] in commands, argv
    commands[argv[1]].make_context(argv[1], argv[2:])  # a usage error (unknown option, bad value) raises here


def test_the_command_check_catches_a_wrong_option():
    from lynxkv.cli.app import build_command

    with pytest.raises(Exception, match="No such option: --bandwith"):
        build_command().commands["run"].make_context("run", ["doc.lynx", "--bandwith", "60Mbps"])


@pytest.mark.slow
def test_readme_python_example_runs_as_written(smollm2, tmp_path, monkeypatch, capsys):
    """The example, unchanged, in a fresh directory (``load_model()`` is the session's offline SmolLM2): it writes
    the two files, and its tokens are those of plain greedy decoding on the stored full code."""
    import lynxkv
    from lynxkv.speculative import decode_plain

    (code,) = _blocks(README, "python")
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert "acceptance_rate" in capsys.readouterr().out
    assert (tmp_path / "doc.lynx").exists() and (tmp_path / "doc.lynxr").exists()
    with lynxkv.open_cache(tmp_path / "doc.lynx") as cache:
        full = cache.load_kv()
        prompt = list(cache.info.prompt_token_ids)
    result = ns["result"]
    assert result.token_ids == decode_plain(smollm2.model, full, prompt, 32,
                                            first_forward=result.stats.draft_token_ids)
