"""A KV dump's safetensors header is a claim: read without mapping the file, every offset, size and dtype checked
against the file before a tensor is read (a dump larger than memory is read a tensor at a time)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from cli_helpers import one_error, run_cli
from lynxkv.cache.dumps import open_dump, save_kv_safetensors


def _dump(path, tokens: int = 16) -> None:
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(2, tokens, 32, generator=g).bfloat16(), torch.randn(2, tokens, 32, generator=g).bfloat16())
          for _ in range(2)]
    save_kv_safetensors(path, kv)


def _patch_header(path, change) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    change(doc)
    head = json.dumps(doc).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])


def test_layers_read_one_at_a_time_are_the_tensors_written(tmp_path):
    _dump(tmp_path / "kv.safetensors")
    from safetensors.torch import load_file

    want = load_file(tmp_path / "kv.safetensors")
    got = list(open_dump(tmp_path / "kv.safetensors").iter_layers())
    for i, (k, v) in enumerate(got):
        assert torch.equal(k, want[f"layers.{i}.key"]) and torch.equal(v, want[f"layers.{i}.value"])


@pytest.mark.parametrize("change, why", [
    (lambda d: d["layers.0.key"].update(data_offsets=[0, 1 << 40]), "outside the file"),
    (lambda d: d["layers.0.key"].update(shape=[2, 17, 32]), "bytes for shape"),
    (lambda d: d["layers.1.value"].update(data_offsets="x"), "malformed"),
    (lambda d: d.update(__metadata__={"a": 1}), "__metadata__"),
])
def test_a_header_that_lies_is_one_clear_error(tmp_path, capsys, change, why):
    path = tmp_path / "kv.safetensors"
    _dump(path)
    _patch_header(path, change)
    err = one_error(capsys, "encode", path, "-o", tmp_path / "c.lynx")
    assert "not a readable safetensors file" in err and why in err
    assert not (tmp_path / "c.lynx").exists()


def test_a_header_length_past_the_file_or_a_truncated_file_is_refused(tmp_path, capsys):
    path = tmp_path / "kv.safetensors"
    _dump(path)
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 50) + raw[8:])
    assert "a header of" in one_error(capsys, "encode", path, "-o", tmp_path / "c.lynx")
    path.write_bytes(raw[:-100])
    assert "outside the file" in one_error(capsys, "encode", path, "-o", tmp_path / "c.lynx")
    path.write_bytes(raw)
    assert run_cli(capsys, "encode", path, "-o", tmp_path / "c.lynx")[0] == 0
