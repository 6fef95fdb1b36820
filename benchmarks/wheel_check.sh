#!/usr/bin/env bash
# What a user installs, checked end to end, offline: the sdist of the working tree (tracked and new files), the
# wheel built from that sdist, installed into a fresh venv outside the checkout, then run from an empty directory:
#   lynxkv --version; lynxkv encode / verify / decode of a small safetensors dump; the decoded tensors have the
#   dump's names, shapes and dtype, are within the quantizer's error of it and equal the Python API's load_kv.
# Where a C compiler is found, the installed wheel must hold all three compiled modules (an extension that fails
# to compile is skipped silently by the build, so only this check would notice). NO_COMPILER=1 builds as a machine
# without one does (CC=false): the build must go on, the wheel hold no compiled module, and the round trip work
# through the pure-Python paths.
#
#   benchmarks/wheel_check.sh                  # with the running venv's python (PYTHON=... to choose another)
#   NO_COMPILER=1 benchmarks/wheel_check.sh    # what an install without a C compiler gets
#
# Nothing is downloaded: the build runs without isolation (setuptools and cffi from $PYTHON's environment) and the
# wheel is installed with --no-deps; its dependencies (torch, numpy, ...) are those of $PYTHON's environment, put
# after the fresh venv's own site-packages on its path. Exit status 0 when every check passes.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$(command -v python)}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/lynxkv-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
step() { echo "wheel_check: $*" >&2; }

step "source tree -> $WORK/src"
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/run"
(cd "$ROOT" && git ls-files -z -co --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null) |
    tar -x -C "$WORK/src"

step "sdist (PEP 517 hook, no isolation)"
(cd "$WORK/src" && "$PYTHON" -c "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])" \
    "$WORK/dist" >"$WORK/sdist.log" 2>&1) || { tail -20 "$WORK/sdist.log"; exit 1; }
SDIST="$(ls "$WORK"/dist/lynxkv-*.tar.gz)"

COMPILER=0
if [ "${NO_COMPILER:-0}" = 1 ]; then
    export CC=false CXX=false
elif command -v "${CC:-cc}" >/dev/null 2>&1; then
    COMPILER=1
fi
step "wheel from $(basename "$SDIST") (C compiler: $COMPILER)"
(cd "$WORK" && "$PYTHON" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$WORK/dist" "$SDIST" \
    >"$WORK/wheel.log" 2>&1) || { tail -20 "$WORK/wheel.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/lynxkv-*.whl)"

step "fresh venv, $(basename "$WHEEL") installed with --no-deps"
"$PYTHON" -m venv --without-pip "$WORK/venv"
SITE="$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
DEPS="$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
echo "$DEPS" >"$SITE/zz-lynxkv-dependencies.pth"  # a plain path: its own .pth files (editable installs) not run
"$PYTHON" -m pip --python "$WORK/venv/bin/python" install -q --no-deps --no-index "$WHEEL"

cd "$WORK/run"
export LYNXKV_CPU_THREADS=1
VENV_PY="$WORK/venv/bin/python"
step "lynxkv --version"
"$WORK/venv/bin/lynxkv" --version

"$VENV_PY" - "$SITE" "$COMPILER" <<'EOF'
import sys
from pathlib import Path
import lynxkv
from lynxkv.format import checksum
from lynxkv.quant import fast, remainder

site, compiler = Path(sys.argv[1]).resolve(), sys.argv[2] == "1"
where = Path(lynxkv.__file__).resolve()
assert where.is_relative_to(site), f"lynxkv imported from {where}, not from the installed wheel in {site}"
built = {"quant kernels": fast.native(), "exact remainder": remainder.compiled(), "checksum": checksum._CRC is not None}
print("wheel_check: compiled modules:", ", ".join(f"{k}: {v}" for k, v in built.items()), file=sys.stderr)
if compiler:
    assert all(built.values()), f"a C compiler is here, but the wheel lacks a compiled module: {built}"
else:
    assert not any(built.values()), f"built without a C compiler, yet compiled modules run: {built}"
EOF

step "encode / verify / decode round trip"
"$VENV_PY" - <<'EOF'
import torch
from safetensors.torch import save_file
g = torch.Generator().manual_seed(0)
save_file({f"layers.{i}.{part}": (torch.randn(2, 300, 64, generator=g) * (1 + i)).to(torch.bfloat16)
           for i in range(2) for part in ("key", "value")}, "kv.safetensors")
EOF
"$WORK/venv/bin/lynxkv" encode kv.safetensors -o x.lynx >/dev/null
"$WORK/venv/bin/lynxkv" verify x.lynx --against kv.safetensors >/dev/null
"$WORK/venv/bin/lynxkv" decode x.lynx -o back.safetensors >/dev/null
"$VENV_PY" - <<'EOF'
import sys
import torch
from safetensors.torch import load_file
import lynxkv
original, back = load_file("kv.safetensors"), load_file("back.safetensors")
assert sorted(original) == sorted(back), (sorted(original), sorted(back))
with lynxkv.open_cache("x.lynx") as cache:
    api = cache.load_kv()
for i, pair in enumerate(api):
    for part, values in zip(("key", "value"), pair):
        name = f"layers.{i}.{part}"
        x, y = original[name], back[name]
        assert y.shape == x.shape and y.dtype == x.dtype, (name, y.shape, y.dtype)
        assert torch.equal(y.view(torch.int16), values.reshape(y.shape).view(torch.int16)), name
        err = ((y.float() - x.float()).pow(2).mean() / x.float().pow(2).mean()).item()
        assert err < 1e-3, (name, err)  # the 8-bit code's vNMSE is ~1e-5
print("wheel_check: round trip ok:", len(original), "tensors", file=sys.stderr)
EOF
step "ok"
