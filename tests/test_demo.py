"""`lynxkv demo` (the README's first command) runs end to end on the real offline model, at a small size."""

from __future__ import annotations

import pytest

from lynxkv.cli import main

pytestmark = pytest.mark.slow


def test_demo_runs_the_whole_pipeline(tmp_path, capsys):
    code = main(["demo", "--dir", str(tmp_path), "--tokens", "120", "-n", "8", "--residual-steps", "6"])
    out = capsys.readouterr().out
    assert code == 0
    assert (tmp_path / "hot" / "demo.lynx").exists() and (tmp_path / "cold" / "demo.lynxr").exists()
    assert "reconstruction error" in out and "Summary" in out
    assert "identical to decoding on the full code" in out
