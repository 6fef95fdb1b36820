#!/usr/bin/env bash
# One command on a CUDA machine: the kernel tests on the GPU, then the GPU benchmark (Llama-3-8B shape, 8K tokens).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; writes into $OUT (if set) or ./out
#
# lynxkv need not be installed: the script builds a throw-away import root in which `lynxkv` points at the
# repository's lynxkv/ and `lynxkv.kernels` at kernels/ (the package-dir mapping of pyproject.toml), and puts
# it on PYTHONPATH. Needs python3 with torch (CUDA), triton, numpy, pytest. Finishes in well under 4 minutes.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$REPO/out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu_check.log"
PY="${PYTHON:-python3}"
exec > >(tee "$LOG") 2>&1

ROOT="$(mktemp -d)"
trap 'rm -rf "$ROOT"' EXIT
mkdir -p "$ROOT/lynxkv"
for entry in "$REPO"/lynxkv/*; do
    name="$(basename "$entry")"
    [ "$name" = "__pycache__" ] || ln -s "$entry" "$ROOT/lynxkv/$name"
done
ln -s "$REPO/kernels" "$ROOT/lynxkv/kernels"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') in $REPO"
"$PY" - <<'PY' || { echo "FAILED: environment"; exit 2; }
import torch, triton
import lynxkv.kernels.encode, lynxkv.kernels.decode
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}")
assert torch.cuda.is_available(), "no CUDA device visible"
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null || true

echo "== kernel tests on the GPU (pytest -m cuda)"
cd "$REPO"
timeout 170 "$PY" -m pytest -q -m cuda tests/test_kernels.py -p no:cacheprovider -o addopts="" \
    --junitxml="$OUT_DIR/gpu_tests.xml"
TESTS=$?

echo "== GPU benchmark (Llama-3-8B shape: 32 layers x K,V, 8 KV heads, head_dim 128; 1K and 8K tokens)"
timeout 150 "$PY" benchmarks/bench_gpu.py --tokens 1024 8192 --json "$OUT_DIR/gpu_bench.json"
BENCH=$?

echo "== done: tests rc=$TESTS, benchmark rc=$BENCH; log $LOG, results $OUT_DIR/gpu_bench.json"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
