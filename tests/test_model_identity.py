"""Which model made a cache: its name (and revision) recorded beside the fingerprint, checked before any weights
are loaded; an input file's own metadata kept through encode and decode (the header's properties)."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_tiny_model
from lynxkv import FormatError, open_cache
from lynxkv.cli import main
from lynxkv.format import constants as c
from runner_helpers import prompt_ids, save_tiny_model_dir, single_thread, text_of

_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    one = save_tiny_model_dir(make_tiny_model("llama", seed=1), root / "one")
    other = save_tiny_model_dir(make_tiny_model("llama", seed=2), root / "other")
    (root / "p.txt").write_text(text_of(prompt_ids(8, 40)))
    assert main(["encode", "--model", one, "--prompt-file", str(root / "p.txt"), "-o", str(root / "x.lynx")]) == 0
    return root, one, other


def test_the_model_name_is_recorded(encoded, capsys):
    root, one, _ = encoded
    code, out, _ = _run(capsys, "inspect", root / "x.lynx", "--json")
    assert code == 0 and json.loads(out)["properties"]["lynxkv.model"] == os.path.realpath(one)
    code, out, _ = _run(capsys, "inspect", root / "x.lynx")
    assert os.path.realpath(one) in out


def test_run_refuses_another_model_before_loading_weights(encoded, capsys, monkeypatch):
    import lynxkv.hf.models as models

    root, one, other = encoded

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(models, "load_model", no_loading)
    code, out, err = _run(capsys, "run", root / "x.lynx", "--model", other, "-n", "4")
    assert code == 1 and out == ""
    assert f"the cache was made with model '{os.path.realpath(one)}'" in err and len(err.strip().splitlines()) == 1


def test_run_loads_the_recorded_model_only_when_asked(encoded, capsys, monkeypatch):
    """Without --model a cache made with another model than the offline default is refused before anything
    loads, naming the --model to pass: a cache never makes lynxkv read a model directory (or download a hub
    model) that the user did not name. With it, the run goes ahead."""
    import lynxkv.hf.models as models

    root, one, _ = encoded
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    code, out, err = _run(capsys, "run", root / "x.lynx", "-n", "4")
    assert code == 1 and out == "" and f"pass --model {os.path.realpath(one)}" in err
    monkeypatch.setattr(models, "load_model", real)
    code, out, err = _run(capsys, "run", root / "x.lynx", "-n", "4", "--json", "--ignore-eos", "--model", one)
    assert code == 0, err
    assert len(json.loads(out)["token_ids"]) == 4


def test_the_recorded_name_survives_a_tier_move(encoded, capsys, tmp_path):
    root, one, _ = encoded
    assert _run(capsys, "tier", root / "x.lynx", tmp_path / "y.lynx", "--residual-out", tmp_path / "y.lynxr",
                "--keep")[0] == 0
    with open_cache(tmp_path / "y.lynx") as cache:
        assert cache.info.properties["lynxkv.model"] == os.path.realpath(one)


def test_input_metadata_survives_encode_and_decode(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.0.{kind}": torch.randn(2, 30, 8, generator=g) for kind in ("key", "value")}
    save_file(tensors, tmp_path / "kv.safetensors", metadata={"producer": "my-engine 1.2", "model": "m/x"})
    assert _run(capsys, "encode", tmp_path / "kv.safetensors", "-o", tmp_path / "x.lynx")[0] == 0
    assert _run(capsys, "decode", tmp_path / "x.lynx", "-o", tmp_path / "back.safetensors")[0] == 0
    with safe_open(str(tmp_path / "back.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["producer"] == "my-engine 1.2" and meta["model"] == "m/x" and meta["lynxkv.reconstruction"] == "full"


def test_a_header_whose_properties_are_not_a_json_object_is_refused(tmp_path):
    from lynxkv import save_cache

    kv = [(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2))]
    save_cache(tmp_path / "x.lynx", kv, single_file=True, properties={"k": "v"})
    a = bytearray((tmp_path / "x.lynx").read_bytes())
    assert struct.unpack_from("<H", a, 10)[0] == 0 and struct.unpack_from("<I", a, 12)[0] & c.FLAG_PROPERTIES
    start = a.index(b'{"k":"v"}')
    a[start:start + 9] = b'["k","v"]'
    length = struct.unpack_from("<I", a, 16)[0]
    struct.pack_into("<I", a, length - 4, zlib.crc32(bytes(a[: length - 4])))
    with pytest.raises(FormatError, match="`properties` at anchor byte"):
        open_cache(bytes(a))


def test_a_hub_model_the_cache_names_is_never_downloaded_unasked(encoded, capsys, monkeypatch, tmp_path):
    """A cache recording a hub id loads nothing without --model (one line naming the --model to pass); named by
    the user, the model is fetched as usual."""
    import transformers

    from lynxkv import save_cache
    from lynxkv.hf import models

    root, one, _ = encoded
    with open_cache(root / "x.lynx") as cache:
        kv, info = cache.load_kv(), cache.info
    save_cache(tmp_path / "h.lynx", kv, prompt_token_ids=info.prompt_token_ids,
               properties={"lynxkv.model": "someorg/othermodel"})
    asked = []

    def offline(name, **kwargs):
        asked.append(name)
        raise OSError(f"{name} is not in the local cache")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    models._load_cached.cache_clear()
    code, out, err = _run(capsys, "run", tmp_path / "h.lynx", "-n", "2")
    assert code == 1 and out == "" and asked == [] and "pass --model someorg/othermodel" in err
    code, out, err = _run(capsys, "run", tmp_path / "h.lynx", tmp_path / "h.lynx", "-n", "2")  # a batch too
    assert code == 1 and asked == [] and err.count("pass --model someorg/othermodel") == 2
    code, out, err = _run(capsys, "run", tmp_path / "h.lynx", "-n", "2", "--model", "someorg/othermodel")
    assert code == 1 and asked == ["someorg/othermodel"]  # named by the user: fetched as usual
