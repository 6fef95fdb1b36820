"""Command-line conventions and bad dumps: one clear line per error, nothing written, nothing lost to markup,
numbers never truncated off a terminal, ``--version``, ``--json`` where a script reads the output."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from lynxkv import __version__
from cli_helpers import one_error as _one_error, run_cli as _run


def _dump(path, shape, *, metadata=None):
    g = torch.Generator().manual_seed(0)
    save_file({f"layers.0.{kind}": torch.randn(shape, generator=g) for kind in ("key", "value")}, path,
              metadata=metadata)


def test_version(capsys):
    code, out, _ = _run(capsys, "--version")
    assert code == 0 and out.strip() == f"lynxkv {__version__}"


def test_help_shows_switches_as_switches(capsys, monkeypatch):
    """Every command's --help: a switch such as --force takes no value, so no ``<bool>`` label beside it; options
    that take one keep theirs."""
    monkeypatch.setenv("COLUMNS", "200")
    from lynxkv.cli.app import build_command

    names = list(build_command().commands)
    assert {"encode", "run", "serve", "eval"} <= set(names)
    for name in [None, *names]:
        code, out, _ = _run(capsys, *([name] if name else []), "--help")
        assert code == 0 and "--help" in out
        assert "<bool>" not in out, f"lynxkv {name or ''} --help"
    _, out, _ = _run(capsys, "encode", "--help")
    assert "<path>" in out and "<int" in out


def test_token_major_dump_is_refused(tmp_path, capsys):
    _dump(tmp_path / "kv.safetensors", (300, 2, 16))  # [tokens, kv_heads, head_dim]
    err = _one_error(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "x.lynx")
    assert "looks token-major [tokens, kv_heads, head_dim]" in err and "(300, 2, 16)" in err
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]


def test_heads_major_metadata_accepts_a_cache_shorter_than_its_heads(tmp_path, capsys):
    _dump(tmp_path / "kv.safetensors", (8, 3, 16), metadata={"lynxkv.layout": "kv_heads,tokens,head_dim"})
    code, out, _ = _run(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "x.lynx", "--json")
    assert code == 0 and (json.loads(out)["kv_heads"], json.loads(out)["tokens"]) == (8, 3)


def test_batch_of_two_is_refused(tmp_path, capsys):
    _dump(tmp_path / "kv.safetensors", (2, 2, 40, 16))
    err = _one_error(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "x.lynx")
    assert "a batch of 2 sequences" in err
    assert sorted(os.listdir(tmp_path)) == ["kv.safetensors"]


def test_messages_keep_their_brackets(tmp_path, capsys):
    _dump(tmp_path / "kv.safetensors", (40, 16))  # 2-d: the message names the expected [..] layouts
    err = _one_error(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "x.lynx")
    assert "expected [kv_heads, tokens, head_dim] or [1, kv_heads, tokens, head_dim]" in err


def test_missing_prompt_file_is_one_clear_error(tmp_path, capsys):
    err = _one_error(capsys, "run", tmp_path / "x.lynx", "--prompt", f"@{tmp_path / 'nope.txt'}")
    assert "nope.txt: no such file" in err


def test_decode_json_and_untruncated_tables(tmp_path, capsys):
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "and-another-one-to-pass-eighty-columns"
    deep.mkdir(parents=True)
    _dump(deep / "kv.safetensors", (2, 40, 16))
    assert _run(capsys, "encode", deep / "kv.safetensors", "-o", deep / "x.lynx")[0] == 0
    code, out, _ = _run(capsys, "decode", deep / "x.lynx", "-o", deep / "back.safetensors", "--json")
    d = json.loads(out)
    assert code == 0 and (d["layers"], d["kv_heads"], d["tokens"], d["head_dim"], d["dtype"]) == (1, 2, 40, 16, "fp32")
    assert d["reconstruction"] == "full" and d["names"] == ["layers.0.key", "layers.0.value"]
    code, out, _ = _run(capsys, "inspect", deep / "x.lynx")  # stdout is not a terminal here
    assert code == 0 and "…" not in out and str(deep / "x.lynx") in out
