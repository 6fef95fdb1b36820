"""Disaggregated prefill and decode across a real shaped link (lynxkv.bench.netlab): ``lynxkv prefill`` runs a tiny
random Llama (saved as a model directory) in the lab's server namespace and publishes the cache while it encodes
it; ``lynxkv run http://...`` decodes from it in the client namespace, over a 2 Mbit/s link shaped per DSCP class.
The decoder's tokens equal plain greedy decoding on the cache's full code (the copy the prefill saved to its tier);
a prefill killed while the residual is on the wire ends the decoder with one ``lynxkv: error:`` line, or lets it
finish flagged on the anchor with ``--allow-anchor-only``, and so does a ``lynxkv serve`` stopped (SIGSTOP) in the
middle of the residual, its connections open, within ``--residual-timeout``; a link cut in the middle of the
residual resumes.
Needs root and iproute2; skips with the reason otherwise."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from cli_helpers import served_url
from runner_helpers import store_prefill, tiny_llama_cache, word

from lynxkv.bench.netlab import NetLab, can_create_lab
from lynxkv.cache import open_cache
from lynxkv.speculative import decode_plain

pytestmark = [pytest.mark.network]

NEW = 12
PROMPT_WORDS = 1200


@pytest.fixture(scope="module")
def lab():
    reason = can_create_lab()
    if reason is not None:
        pytest.skip(reason)
    with NetLab(rate="2Mbit") as lab:
        yield lab


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model, model_dir, *_ = tiny_llama_cache(d)
    rng = random.Random(5)
    prompt = d / "prompt.txt"
    prompt.write_text(" ".join(word(rng.randrange(2, 128)) for _ in range(PROMPT_WORDS)))
    return model, model_dir, prompt


def _prefill(lab: NetLab, tiny, out, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start ``lynxkv prefill`` in the server namespace (it prefills when the first client asks); its URL."""
    _, model_dir, prompt = tiny
    proc = lab.popen("server", [sys.executable, "-m", "lynxkv", "prefill", "--model", model_dir, "--prompt-file",
                                prompt, "--host", lab.server_addr, "--port", "0", "--out", out, "--start-on-request",
                                "--dscp-anchor", "EF", "--dscp-residual", "CS1", "--json", *extra],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, served_url(proc)


def _decode(lab: NetLab, tiny, url: str, *extra: str, residual_timeout: float = 20) -> subprocess.Popen:
    return lab.popen("client", [sys.executable, "-m", "lynxkv", "run", url, "--model", tiny[1], "--max-new-tokens",
                                str(NEW), "--ignore-eos", "--json", "--residual-timeout", str(residual_timeout),
                                *extra],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _when_sent(lab: NetLab, proc: subprocess.Popen, klass: str, nbytes: float, *, since: int | None = None,
               within: float = 60) -> None:
    """Return once the server has sent ``nbytes`` in ``klass`` (its class counter) since ``since`` (default: now),
    the decoder ``proc`` still running."""
    start = lab.class_bytes("server")[klass] if since is None else since
    deadline = time.monotonic() + within
    while lab.class_bytes("server")[klass] - start < nbytes:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{nbytes:.0f} bytes of {klass} not sent within {within:g} s"
        time.sleep(0.02)


def _when_residual_moves(lab: NetLab, proc: subprocess.Popen, nbytes: int = 30_000) -> None:
    """Return once the server has sent ``nbytes`` of residual, the decoder still running."""
    _when_sent(lab, proc, "residual", nbytes)


def _reference(tiny, cache_path, result: dict, *, anchor_only: bool = False) -> list[int]:
    """Plain greedy decoding on the saved cache's full code (or its anchor), in the runner's forward shapes."""
    with open_cache(str(cache_path)) as cache:
        kv = cache.load_kv(anchor_only=anchor_only, dtype=torch.float32)
        ids = cache.info.prompt_token_ids
    s = result["stats"]
    if anchor_only:
        return decode_plain(tiny[0], kv, ids, NEW, stop_token_ids=())
    return decode_plain(tiny[0], kv, ids, NEW, first_forward=s["draft_token_ids"],
                        branch=(s["branch_at"], s["branch_token_ids"]), stop_token_ids=())


def test_a_prefill_killed_mid_residual_ends_the_decoder_cleanly_or_flagged(lab, tiny, tmp_path):
    out = tmp_path / "c.lynx"
    # a small send buffer: what the process has not handed to its socket dies with it
    start = lab.class_bytes("server")["anchor"]
    prefill, url = _prefill(lab, tiny, out, "--write-buffer", "16KiB")
    try:
        # one decoder after the other, so that each has its whole anchor before the kill (a decoder that starts
        # late would meet a dead server before its first byte: another fault than this test's)
        lenient = _decode(lab, tiny, url, "--allow-anchor-only")
        _when_residual_moves(lab, lenient)
        one_anchor = lab.class_bytes("server")["anchor"] - start
        strict = _decode(lab, tiny, url)
        # (2% short of twice the first decoder's: how its bytes fall into packets varies a little from run to run)
        _when_sent(lab, strict, "anchor", 2 * 0.98 * one_anchor, since=start)
        _when_residual_moves(lab, strict)
        prefill.kill()
        prefill.communicate()
        s_out, s_err = strict.communicate(timeout=60)
        l_out, l_err = lenient.communicate(timeout=60)
    finally:
        prefill.kill()
    assert strict.returncode != 0 and s_out == ""
    errors = [line for line in s_err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("lynxkv: error:"), s_err
    assert lenient.returncode == 0, l_err
    result = json.loads(l_out)
    if result["verified"]:  # the residual was all in before the kill: then it is exact
        assert result["token_ids"] == _reference(tiny, out, result)
    else:  # flagged: the tokens are greedy decoding on the anchor, never a mix
        assert result["token_ids"] == _reference(tiny, out, result, anchor_only=True)


def test_decoder_reads_a_prefill_still_publishing_across_a_link_cut_and_decodes_exactly(lab, tiny, tmp_path):
    out = tmp_path / "c.lynx"
    before = lab.class_bytes("server")
    prefill, url = _prefill(lab, tiny, out)
    try:
        decoder = _decode(lab, tiny, url)
        _when_residual_moves(lab, decoder)
        lab.link_down()  # mid-residual: the connections stay and retransmit once it is back
        time.sleep(1.5)
        lab.link_up()
        stdout, stderr = decoder.communicate(timeout=90)
        assert decoder.returncode == 0, stderr
    finally:
        lab.link_up()
        prefill.terminate()
        _, p_err = prefill.communicate(timeout=30)
    assert prefill.returncode == 0, p_err  # SIGTERM: a clean stop
    result = json.loads(stdout)
    assert result["verified"] is True and len(result["token_ids"]) == NEW
    assert result["token_ids"] == _reference(tiny, out, result)
    sent = {k: v - before[k] for k, v in lab.class_bytes("server").items()}  # each segment in its DSCP class
    assert sent["anchor"] >= out.stat().st_size and sent["residual"] >= out.with_suffix(".lynxr").stat().st_size


def _serve(lab: NetLab, cache: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """Start ``lynxkv serve`` of a finished cache in the server namespace; its URL."""
    proc = lab.popen("server", [sys.executable, "-m", "lynxkv", "serve", cache, "--host", lab.server_addr, "--port",
                                "0", "--json", "--dscp-anchor", "EF", "--dscp-residual", "CS1", *extra],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, served_url(proc)


@pytest.fixture(scope="module")
def stored(tiny, tmp_path_factory):
    """The tiny model's cache of a random prompt, finished and stored (what ``lynxkv serve`` serves)."""
    path = str(tmp_path_factory.mktemp("stored") / "s.lynx")
    rng = random.Random(6)
    store_prefill(tiny[0], [rng.randrange(2, 128) for _ in range(PROMPT_WORDS)], path)
    return path


@pytest.fixture(scope="module")
def one_decoder(lab, tiny, stored) -> dict[str, int]:
    """The bytes one decoder of ``stored`` takes per DSCP class, alone on the link (its header read, then the load)."""
    server, url = _serve(lab, stored)
    try:
        before = lab.class_bytes("server")
        out, err = _decode(lab, tiny, url).communicate(timeout=120)
        assert json.loads(out)["verified"] is True, err
        return {k: v - before[k] for k, v in lab.class_bytes("server").items()}
    finally:
        server.kill()
        server.communicate()


def _stall_mid_residual(lab: NetLab, tiny, stored: str, anchor_bytes: int, *extra: str, timeout: float):
    """A decoder alone on the link, its server stopped (SIGSTOP) once the decoder holds its whole anchor (``anchor_bytes``
    of the anchor class since it started, 2% short for how they fall into packets) and residual bytes are on the
    wire: (the stopped server, the decoder, when the server stopped)."""
    server, url = _serve(lab, stored, "--write-buffer", "16KiB")
    start = lab.class_bytes("server")["anchor"]
    decoder = _decode(lab, tiny, url, *extra, residual_timeout=timeout)
    _when_sent(lab, decoder, "anchor", 0.98 * anchor_bytes, since=start, within=120)
    _when_residual_moves(lab, decoder)
    server.send_signal(signal.SIGSTOP)
    return server, decoder, time.monotonic()


def test_a_server_that_stalls_mid_residual_ends_the_decoder_within_its_residual_timeout(lab, tiny, stored,
                                                                                        one_decoder):
    """A server stopped (SIGSTOP) while the residual is on the wire keeps its connections open and sends nothing
    more, nor answers a retry: the decoder's --residual-timeout ends it with one error line, or with
    --allow-anchor-only on the anchor, flagged; neither hangs nor prints tokens that are not the anchor's. (One
    decoder at a time, each with its own server: the bytes on the link are then the one decoder's.)"""
    timeout = 10.0
    servers = []
    try:
        server, strict, stopped = _stall_mid_residual(lab, tiny, stored, one_decoder["anchor"], timeout=timeout)
        servers.append(server)
        server, lenient, l_stopped = _stall_mid_residual(lab, tiny, stored, one_decoder["anchor"],
                                                         "--allow-anchor-only", timeout=timeout)
        servers.append(server)
        s_out, s_err = strict.communicate(timeout=timeout + 60)  # guards: the bounds are asserted below
        s_ended = time.monotonic() - stopped
        l_out, l_err = lenient.communicate(timeout=timeout + 60)
        l_ended = time.monotonic() - l_stopped
    finally:
        for server in servers:
            server.send_signal(signal.SIGCONT)
            server.kill()
            server.communicate()
    # the residual timeout (counted from before the stop) ended both, not the transport's four stalls of 10 s
    assert s_ended < timeout + 15 and l_ended < timeout + 15
    assert strict.returncode == 1 and s_out == "", s_out
    errors = [line for line in s_err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("lynxkv: error:") and "residual" in errors[0], s_err
    assert lenient.returncode == 0, l_err
    result = json.loads(l_out)
    assert result["verified"] is False and "residual" in result["stats"]["residual_error"]
    assert result["token_ids"] == _reference(tiny, stored, result, anchor_only=True)
