"""`lynxkv encode / decode / inspect / verify` through the real entry point (exit codes, stdout JSON)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lynxkv.cli import main
from lynxkv.quant.scheme import Scheme


def _dump(path, *, style="layers", batched=False, dtype=torch.bfloat16, layers=3, h=2, t=300, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for kind in ("key", "value"):
            x = torch.randn((h, t, d), generator=g) * (1 + i)
            tensors[f"{style}.{i}.{kind}"] = (x.unsqueeze(0) if batched else x).to(dtype)
    save_file(tensors, path)
    return tensors


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("style, batched", [("layers", False), ("past_key_values", True)])
def test_encode_decode_keeps_names_shapes_and_dtype(tmp_path, capsys, style, batched):
    src = tmp_path / "kv.safetensors"
    original = _dump(src, style=style, batched=batched)
    assert run(capsys, "encode", src, "-o", tmp_path / "c.lynx")[0] == 0
    assert (tmp_path / "c.lynxr").exists()
    assert run(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "back.safetensors")[0] == 0
    with safe_open(tmp_path / "back.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(original)
        for name, x in original.items():
            y = f.get_tensor(name)
            assert y.shape == x.shape and y.dtype == x.dtype
            assert float((y.float() - x.float()).abs().max()) < 0.05 * float(x.float().abs().max())


def test_inspect_json_has_stable_keys(tmp_path, capsys):
    src = tmp_path / "kv.safetensors"
    _dump(src)
    run(capsys, "encode", src, "-o", tmp_path / "c.lynx", "--chunk", "16", "--page", "64")
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json")
    d = json.loads(out)
    assert code == 0
    assert (d["tokens"], d["layers"], d["kv_heads"], d["head_dim"]) == (300, 3, 2, 8)
    assert d["scheme"]["chunk"] == 16 and d["scheme"]["page"] == 64
    scheme = Scheme(**d["scheme"])  # headers and page indexes add a little (0.3 bits here) to the scheme's own count
    assert 0 < d["bits_per_element"]["total"] - scheme.bits_per_element(tokens=300, head_dim=8) < 0.5
    assert 0 < d["bits_per_element"]["anchor"] - scheme.bits_per_element(anchor_only=True, tokens=300, head_dim=8) < 0.5
    assert d["residual_reachable"] is True
    assert "prompt_token_ids" not in d  # a dump carries none


@pytest.mark.parametrize("argv, rotation", [([], "hadamard"),
                                            (["--extremes", "midpoint"], "hadamard"),
                                            (["--key-rotation", "none", "--alpha", "1", "--extremes", "midpoint"],
                                             "none"),
                                            (["--scheme", "linear", "--key-rotation", "hadamard"], "hadamard")],
                         ids=["default", "midpoint", "not-rotated", "linear-rotated"])
def test_key_rotation_override_is_in_the_file(tmp_path, capsys, argv, rotation):
    src = tmp_path / "kv.safetensors"
    tensors = _dump(src, layers=1, d=16)
    assert run(capsys, "encode", src, "-o", tmp_path / "c.lynx", *argv)[0] == 0
    d = json.loads(run(capsys, "inspect", tmp_path / "c.lynx", "--json")[1])
    assert d["scheme"]["key_rotation"] == rotation and d["format_version"] == "1.0"
    assert run(capsys, "decode", tmp_path / "c.lynx", "-o", tmp_path / "back.safetensors")[0] == 0
    with safe_open(tmp_path / "back.safetensors", "pt") as f:  # the keys come back in their own domain
        k = f.get_tensor("layers.0.key").float()
    want = tensors["layers.0.key"].float()
    assert float((k - want).abs().max()) < 0.05 * float(want.abs().max())


def test_verify_reports_corruption_with_page_and_exit_code(tmp_path, capsys):
    src = tmp_path / "kv.safetensors"
    _dump(src)
    run(capsys, "encode", src, "-o", tmp_path / "c.lynx")
    code, out, _ = run(capsys, "verify", tmp_path / "c.lynx", "--json", "--against", src)
    d = json.loads(out)
    assert code == 0 and d["ok"] is True and d["findings"] == []
    mean = d["vnmse"]["mean"]
    assert mean["key_full"] < mean["key_anchor"] < 0.02

    residual = tmp_path / "c.lynxr"
    data = bytearray(residual.read_bytes())
    data[-10] ^= 0x01  # a payload byte of the last residual page
    residual.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", tmp_path / "c.lynx", "--json")
    d = json.loads(out)
    assert code == 1 and d["ok"] is False
    assert d["findings"][0]["segment"] == "residual" and d["findings"][0]["page"] is not None


def test_existing_output_is_never_overwritten(tmp_path, capsys):
    src = tmp_path / "kv.safetensors"
    _dump(src)
    out = tmp_path / "c.lynx"
    out.write_bytes(b"precious")
    code, _, err = run(capsys, "encode", src, "-o", out)
    assert code == 1 and "already exists" in err and out.read_bytes() == b"precious"
    assert not (tmp_path / "c.lynxr").exists()
    assert run(capsys, "encode", src, "-o", out, "--force")[0] == 0


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["encode", "missing.safetensors", "-o", "x.lynx"], 1, "no such file"),
        (["encode", "{src}", "--model", "smollm2", "-o", "x.lynx"], 1, "either a KV dump file or --model, not both"),
        (["encode", "{src}", "-o", "x.lynx", "--chunk", "24"], 1, "chunk"),
        (["encode", "{src}", "-o", "x.lynx", "--scheme", "nope"], 1, "unknown preset"),
        (["encode", "{src}", "-o", "x.lynx", "--key-rotation", "walsh"], 1, "key_rotation: expected one of"),
        (["decode", "{src}", "-o", "y.safetensors"], 1, "magic"),
        (["decode", "x.lynx", "-o", "y.safetensors", "--dtype", "int3"], 1, "--dtype"),
        (["encode", "--bogus"], 2, "No such option"),
    ],
    ids=["missing-input", "dump-and-model", "bad-chunk", "bad-scheme", "bad-key-rotation", "not-a-lynx-file",
         "bad-dtype", "bad-flag"],
)
def test_bad_input_is_one_clear_error(tmp_path, capsys, monkeypatch, argv, code, message):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "kv.safetensors"
    _dump(src, layers=1, t=40)
    got, out, err = run(capsys, *[a.replace("{src}", str(src)) for a in argv])
    assert got == code
    assert message in err
    assert "Traceback" not in err and out == ""
    if code == 1:
        assert len(err.strip().splitlines()) <= 2  # one line (rich may wrap a long one)


def test_residual_on_another_tier_is_recorded_and_read_back(tmp_path, capsys):
    src = tmp_path / "kv.safetensors"
    _dump(src)
    url = "memory://cold-tier/c.lynxr"
    assert run(capsys, "encode", src, "-o", tmp_path / "c.lynx", "--residual-out", url)[0] == 0
    assert not (tmp_path / "c.lynxr").exists()
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json")
    d = json.loads(out)
    assert d["residual_location"] == url and d["residual_reachable"] is None  # not fetched unless asked
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json", "--check-residual")
    assert json.loads(out)["residual_reachable"] is False  # asked, but the URL is not allowed
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json", "--check-residual",
                       "--allow-location", "memory://cold-tier/")
    assert json.loads(out)["residual_reachable"] is True
    code, out, err = run(capsys, "verify", tmp_path / "c.lynx", "--json")
    assert code == 1 and "--allow-location" in out
    code, out, _ = run(capsys, "verify", tmp_path / "c.lynx", "--json", "--against", src,
                       "--allow-location", "memory://cold-tier/")
    assert code == 0 and json.loads(out)["vnmse"]["mean"]["key_full"] < 1e-4


@pytest.mark.parametrize("model_dtype, argv, stored", [(torch.bfloat16, [], "bf16"), (torch.float16, [], "fp16"),
                                                        (torch.bfloat16, ["--dtype", "fp32"], "fp32")])
def test_encode_model_prefills_in_the_models_own_dtype(tmp_path, capsys, model_dtype, argv, stored):
    """Like transformers' ``dtype="auto"``: a bf16 model's cache holds the bf16 KV it produces, not an fp32
    upcast at twice the bytes, unless --dtype says otherwise; inspect names the dtype the model ran in."""
    from runner_helpers import save_tiny_model_dir, word

    from conftest import make_tiny_llama

    model_dir = save_tiny_model_dir(make_tiny_llama(0).to(model_dtype), tmp_path / "m")
    (tmp_path / "p.txt").write_text(" ".join(word(i % 100 + 2) for i in range(40)))
    code, _, err = run(capsys, "encode", "--model", model_dir, "--prompt-file", tmp_path / "p.txt",
                       "-o", tmp_path / "c.lynx", *argv)
    assert code == 0, err
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx", "--json")
    d = json.loads(out)
    assert d["dtype"] == stored and d["properties"]["lynxkv.model_dtype"] == stored
    code, out, _ = run(capsys, "inspect", tmp_path / "c.lynx")
    assert f"ran in {stored}" in out


def test_encode_dtype_names_auto_among_its_choices(tmp_path, capsys):
    code, _, err = run(capsys, "encode", "--model", "smollm2", "--dtype", "fp64", "-o", tmp_path / "c.lynx")
    assert code == 1 and "lynxkv: error: --dtype: expected one of auto, fp32, fp16, bf16" in err
