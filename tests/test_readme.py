"""The README is the front door: short, every command in it a real one that runs as written (at small sizes), every
link in it and in the other pages resolving, its Python example running as written."""

from __future__ import annotations

import pathlib
import re
import shlex
from typing import Iterator

import pytest
from fixtures_s3 import s3_server  # noqa: F401 (fixture)

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md")),
         *(ROOT / d / n for d, n in (("spec", "FORMAT.md"), ("benchmarks", "README.md"), ("kernels", "README.md")))]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_readme_fits_on_a_few_screens():
    assert len(README.splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_resolves(page):
    missing = _missing_links(page)
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"


def _missing_links(page: pathlib.Path) -> list[str]:
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'<img [^>]*src="([^"]+)"', text)
    local = [link.split("#")[0] for link in links if "://" not in link and not link.startswith(("#", "mailto:"))]
    return [link for link in local if link and not (page.parent / link).exists()]


def test_the_link_check_catches_a_missing_file(tmp_path):
    (tmp_path / "there.md").write_text("")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md), [gone](docs/gone.md#part), ![img](img/none.png), [web](https://example.org/x)")
    assert _missing_links(page) == ["docs/gone.md", "img/none.png"]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_to_a_heading_finds_it(page):
    missing = _missing_anchors(page)
    assert not missing, f"{page.relative_to(ROOT)}: {missing}"


def _headings(page: pathlib.Path) -> Iterator[str]:
    """The anchors a Markdown renderer gives ``page``'s headings (GitHub's rule: lower case, punctuation dropped,
    spaces to hyphens, a repeated heading numbered), code blocks left out."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def _missing_anchors(page: pathlib.Path) -> list[str]:
    missing = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" in link or "#" not in link:
            continue
        path, anchor = link.split("#", 1)
        target = page if not path else page.parent / path
        if target.suffix == ".md" and target.exists() and anchor not in set(_headings(target)):
            missing.append(link)
    return missing


def test_the_heading_check_catches_a_removed_heading(tmp_path):
    (tmp_path / "there.md").write_text("# Title\n\n## The `verify` pass\n\n```sh\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("[a](there.md#the-verify-pass) [b](there.md#gone) [c](there.md#not-a-heading) [d](#title)")
    assert _missing_anchors(page) == ["there.md#gone", "there.md#not-a-heading", "#title"]


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


# ---------------------------------------------------------------------------------------------- run as written
# Every ``lynxkv`` line of the README runs here as written, on the offline SmolLM2. Only what would take minutes on
# a 2-core CPU is made smaller (options appended, which override the README's), ``s3://bucket/`` (and any other
# bucket a line names) is a bucket on a loopback S3 server and port 9000 a free port.


def _smaller(argv: list[str]) -> list[str]:
    if argv[0] == "encode" and "--model" in argv:
        return ["--tokens", "160"]
    if argv[0] == "run":
        return ["-n", "8"]
    if argv[0] == "eval":
        return ["--tokens", "96", "--prompts", "1", "--window", "8", "--ppl-tokens", "8"]
    return []


def _as_run(line: list[str], index: int, bucket: str, port: int) -> list[str]:
    argv = [re.sub(r"^s3://[^/]+/", f"s3://{bucket}/{index}/", a).replace("9000", str(port)) for a in line[1:]]
    return argv + _smaller(argv)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """What the README's lines start from: ``doc.lynx`` + ``doc.lynxr`` + ``doc.lynxe`` of SmolLM2 (encoded with
    ``--exact``, as the exact tier's line says), ``kv.safetensors``, a KV dump (that cache's full code), and the
    batch line's ``a.lynx``, ``b.lynx``, ``c.lynx``: three caches of different lengths."""
    from lynxkv.cli import main

    d = tmp_path_factory.mktemp("stored")
    assert main(["encode", "--model", "smollm2", "--tokens", "160", "--exact", "-o", str(d / "doc.lynx")]) == 0
    assert main(["decode", str(d / "doc.lynx"), "-o", str(d / "kv.safetensors")]) == 0
    for name, tokens in (("a", 96), ("b", 128), ("c", 64)):
        assert main(["encode", "--model", "smollm2", "--tokens", str(tokens), "-o", str(d / f"{name}.lynx")]) == 0
    return d


@pytest.mark.slow
@pytest.mark.network
def test_every_readme_command_runs_as_written(stored, s3_server, tmp_path, monkeypatch, capsys):
    """Each line runs in a copy of ``stored`` with the files it writes removed first, and exits 0 with them
    written (on disk or on S3); ``serve`` runs as its own process, and the ``stream`` line after it copies the
    cache from it: every page verified, both files byte for byte."""
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from lynxkv.cache import verify_file
    from lynxkv.cli import main

    lines = [argv for argv in _readme_commands() if argv[0] == "lynxkv"]
    assert {argv[1] for argv in lines} >= {"encode", "inspect", "verify", "decode", "tier", "serve", "stream",
                                           "run", "eval"}
    port = _free_port()
    server = None
    try:
        for i, line in enumerate(lines):
            argv = _as_run(line, i, s3_server.bucket, port)
            if server is None:
                work = tmp_path / str(i)
                shutil.copytree(stored, work)
            monkeypatch.chdir(work)
            outputs = [argv[argv.index(flag) + 1] for flag in ("-o", "--residual-out", "--exact-out", "--timeline")
                       if flag in argv]
            for name in (n for n in outputs if "://" not in n):
                for path in (work / name, (work / name).with_suffix(".lynxr")):
                    path.unlink(missing_ok=True)
            if argv[0] == "serve":  # runs until stopped; the stream line after it reads from it
                log = work / "serve.log"
                with open(log, "w") as f:
                    server = subprocess.Popen([sys.executable, "-m", "lynxkv", *argv], cwd=work, stderr=f)
                deadline = time.monotonic() + 60
                while "serving" not in log.read_text() and server.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert "serving" in log.read_text(), f"{' '.join(line)}: {log.read_text()[-2000:]}"
                continue
            code = main(argv)
            assert code == 0, f"{' '.join(line)}: {capsys.readouterr().err[-2000:]}"
            capsys.readouterr()
            for name in outputs:
                if "://" in name:
                    assert s3_server.fs().exists(name.removeprefix("s3://")), name
                else:
                    assert (work / name).exists(), name
            if argv[0] == "stream" and server is not None:
                server.send_signal(signal.SIGTERM)
                assert server.wait(30) == 0
                server = None
                assert verify_file(work / "copy" / "doc.lynx") == []
                for name in ("doc.lynx", "doc.lynxr"):
                    assert (work / "copy" / name).read_bytes() == (work / name).read_bytes(), name
        assert server is None, "a serve line with no stream line after it"
    finally:
        if server is not None:
            server.kill()
            server.wait()
