"""The whole runner path on one device: ``lynxkv run --device``, ``load_model(device=)``, ``open_progressive(device=)``.

On the CPU: an explicit device is honoured (every tensor a load hands out is on it, the run's tokens are the
default run's), a device that is not there is refused before anything is loaded, and the modules of the runner's
and the reader's hot path hold no copy back to the host. On a CUDA GPU (marked ``cuda``): the load's KV is on the
GPU with the CPU load's values bit for bit, and ``lynxkv run --device cuda`` decodes the tokens of plain decoding
on the GPU with the run's forward shapes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cli_helpers import one_error, run_cli
from lynxkv.errors import InputError
from lynxkv.hf.models import load_model
from lynxkv.stream.progressive import open_progressive
from runner_helpers import single_thread, tiny_llama_cache

REPO = Path(__file__).resolve().parent.parent
_one_thread = pytest.fixture(scope="module", autouse=True)(single_thread)
MISSING_GPU = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, or the first of none


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, cache path, prompt ids) of a 3-layer tiny Llama and its 300-token cache."""
    _, model_dir, path, ids, _ = tiny_llama_cache(tmp_path_factory.mktemp("device"))
    return model_dir, path, ids


def _progressive(path, device):
    """(anchor KV, full KV) of a progressive load of ``path`` onto ``device`` (None: the default)."""
    with open_progressive(path, room=8, **({} if device is None else {"device": device})) as load:
        return load.wait_anchor(30), load.residual.result(30)


def _on(kv, device_type: str) -> bool:
    return all(t.device.type == device_type for pair in kv for t in pair)


def _same(a, b) -> bool:
    return all(torch.equal(x.to("cpu"), y.to("cpu")) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


# ---- on the CPU ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")], ids=["str", "torch.device"])
def test_progressive_load_honours_an_explicit_cpu_device(tiny, device):
    _, path, _ = tiny
    anchor, full = _progressive(path, device)
    want_anchor, want_full = _progressive(path, None)
    assert _on(anchor, "cpu") and _on(full, "cpu")
    assert _same(anchor, want_anchor) and _same(full, want_full)


@pytest.mark.parametrize("device,says", [("foo", "not a torch device"), ("meta", "hold no values"),
                                         (MISSING_GPU, "not available")], ids=["unknown", "meta", "missing-gpu"])
def test_a_device_that_is_not_there_is_refused_before_anything_is_read(tmp_path, device, says):
    gone = str(tmp_path / "gone.lynx")  # never opened: the device is checked first
    with pytest.raises(InputError, match=says):
        open_progressive(gone, device=device)
    with pytest.raises(InputError, match=says):
        load_model(str(tmp_path / "no-model"), device=device)


def test_load_model_puts_the_model_on_the_device(tiny):
    model_dir, _, _ = tiny
    loaded = load_model(model_dir, device="cpu")
    assert loaded.model.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in loaded.model.parameters())


@pytest.mark.parametrize("device,says", [("foo", "'foo' is not a torch device name"),
                                         ("meta", "hold no values"),
                                         (MISSING_GPU, f"'{MISSING_GPU}' is not available")],
                         ids=["unknown", "meta", "missing-gpu"])
def test_run_refuses_a_device_in_one_line_before_the_model_loads(tmp_path, capsys, device, says):
    """The cache and the model named do not exist: the device's error comes first, so nothing was loaded."""
    err = one_error(capsys, "run", tmp_path / "none.lynx", "--model", tmp_path / "no-model", "--device", device)
    assert err.startswith("lynxkv: error: --device:") and says in err


def test_run_refuses_a_bad_device_for_several_caches_too(tmp_path, capsys):
    err = one_error(capsys, "run", tmp_path / "a.lynx", tmp_path / "b.lynx", "--device", "foo")
    assert "--device: 'foo'" in err


def test_run_on_an_explicit_cpu_device_is_the_default_run(tiny, capsys):
    model_dir, path, _ = tiny
    args = ["run", path, "--model", model_dir, "-n", "12", "--ignore-eos", "--json"]
    runs = []
    for extra in ([], ["--device", "cpu"]):
        code, out, err = run_cli(capsys, *args, *extra)
        assert code == 0, err
        runs.append(json.loads(out))
    assert runs[1]["token_ids"] == runs[0]["token_ids"] and len(runs[1]["token_ids"]) == 12
    assert runs[1]["verified"] is True


def test_device_staging_gathers_the_records_into_one_buffer_and_copies_them():
    """The records of one decode call reach the device as one buffer: the host bytes and their copy are the records
    back to back (on a machine without pinned memory, pageable memory, copied the same way)."""
    from lynxkv.stream.assembly import DeviceStaging

    raws = [b"anchor-0", memoryview(b"--anchor-1--")[2:-2], bytearray(b"x")]
    host, at, copy = DeviceStaging(torch.device("cpu")).copy(raws)
    assert at == [0, 8, 16] and host.tobytes() == b"anchor-0anchor-1x"
    assert copy.dtype == torch.uint8 and copy.device.type == "cpu" and bytes(copy.tolist()) == host.tobytes()


# The modules every step of a run and of a progressive load goes through. A copy to the host there would cost a
# device round trip per step or per page; the exact stage's is its coder's, which runs on the CPU (documented).
HOT_PATH = ["lynxkv/speculative/*.py", "lynxkv/stream/*.py", "lynxkv/hf/convert.py", "lynxkv/hf/growing.py",
            "lynxkv/hf/prefill.py", "lynxkv/hf/attention.py", "lynxkv/format/records.py", "lynxkv/format/reader.py",
            "lynxkv/quant/device_pages.py", "lynxkv/quant/dispatch.py", "lynxkv/cache/loading.py",
            "lynxkv/bench/compare.py", "lynxkv/cli/run.py", "lynxkv/cli/run_batch.py"]
ALLOWED = {("lynxkv/stream/exact_load.py", 'out = [(k.to("cpu", copy=True), v.to("cpu", copy=True)) for k, v in full]')}
HOST_COPY = re.compile(r"""\.cpu\(|\.to\(\s*(device\s*=\s*)?(torch\.device\(\s*)?["']cpu["']""")


def test_the_hot_path_makes_no_copy_to_the_host():
    files = sorted({p for pattern in HOT_PATH for p in REPO.glob(pattern)})
    assert len(files) > 30  # the globs found the modules
    found = {(str(p.relative_to(REPO)), line.strip()) for p in files for line in p.read_text().splitlines()
             if HOST_COPY.search(line)}
    assert found == ALLOWED


# ---- on a CUDA GPU ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_device_staging_copies_through_pinned_memory_onto_the_gpu():
    from lynxkv.stream.assembly import DeviceStaging

    staging = DeviceStaging(torch.device("cuda"))
    with staging.use():
        host, _, copy = staging.copy([b"abc", b"defg"])
    staging.wait()
    assert staging.pinned and copy.is_cuda and bytes(copy.cpu().tolist()) == b"abcdefg" == host.tobytes()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_progressive_load_onto_cuda_is_the_cpu_load(tiny):
    """Anchor and full code decoded on the GPU from pinned, asynchronously copied records: on the GPU, with the
    CPU load's values bit for bit (the room for the runner's cache to grow into is on the GPU too)."""
    _, path, _ = tiny
    anchor, full = _progressive(path, "cuda")
    want_anchor, want_full = _progressive(path, "cpu")
    assert _on(anchor, "cuda") and _on(full, "cuda")
    assert _same(anchor, want_anchor) and _same(full, want_full)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_run_on_cuda_is_plain_decoding_on_cuda(tiny, capsys):
    """``lynxkv run --device cuda`` over an emulated link: the tokens of plain decoding of the full code on the
    GPU, with the run's forward shapes (the verify's multi-token forward rounds as the run's did)."""
    from lynxkv.speculative import decode_plain

    model_dir, path, ids = tiny
    code, out, err = run_cli(capsys, "run", path, "--model", model_dir, "-n", "16", "--ignore-eos", "--json",
                             "--device", "cuda", "--bandwidth", "4MB/s")
    assert code == 0, err
    doc = json.loads(out)
    stats = doc["stats"]
    model = load_model(model_dir, device="cuda").model
    with open_progressive(path, device="cuda") as load:
        full = load.residual.result(30)
    want = decode_plain(model, full, ids, 16, first_forward=list(stats["draft_token_ids"]) or None,
                        branch=(stats["branch_at"], stats["branch_token_ids"]))
    assert doc["verified"] is True and doc["token_ids"] == want


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_seeded_sampling_on_cuda_repeats(tiny, capsys):
    """Sampling draws on the GPU's own generator: a seed gives the same tokens run after run."""
    model_dir, path, _ = tiny
    args = ["run", path, "--model", model_dir, "-n", "12", "--ignore-eos", "--json", "--device", "cuda",
            "--temperature", "0.8", "--seed", "7"]
    runs = []
    for _ in range(2):
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        runs.append(json.loads(out)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) == 12
