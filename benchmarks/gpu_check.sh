#!/usr/bin/env bash
# One command on a CUDA machine: the kernel tests on the GPU, then the GPU benchmark (Llama-3-8B shape, 1K and 8K
# tokens). Writes gpu_check.log, gpu_tests.xml and gpu_bench.json into $OUT (if set) or ./out.
#
#   bash benchmarks/gpu_check.sh
#
# lynxkv need not be installed: the script builds a throw-away import root (a temporary directory) whose lynxkv/
# holds links to the repository's lynxkv/ entries and `lynxkv/kernels` to kernels/, and runs every Python command
# from that root, never from the checkout (whose top-level kernels/ must not be importable as `kernels`). It writes
# nothing into the checkout. Needs python3 with torch (CUDA), triton, numpy, pytest. Takes 1-3 minutes.
#
# GPU_CHECK_DRY=1 runs the same plumbing on a CPU under TRITON_INTERPRET=1 at toy sizes (to test the script).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$REPO/out}"
mkdir -p "$OUT_DIR" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
LOG="$OUT_DIR/gpu_check.log"
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY:-0}"
exec > >(tee "$LOG") 2>&1

ROOT="$(mktemp -d)"
trap 'rm -rf "$ROOT"' EXIT
mkdir -p "$ROOT/lynxkv"
for entry in "$REPO"/lynxkv/*; do
    name="$(basename "$entry")"
    # lynxkv/kernels (a link to ../kernels) is made below: linking it here too would make the next `ln` put its
    # link inside the repository's kernels/ (ln into an existing directory).
    case "$name" in __pycache__|kernels) ;; *) ln -s "$entry" "$ROOT/lynxkv/$name" ;; esac
done
ln -sn "$REPO/kernels" "$ROOT/lynxkv/kernels"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
if [ "$DRY" = "1" ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi

echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') repo $REPO (dry=$DRY)"
"$PY" - "$DRY" <<'PY' || { echo "FAILED: environment (see above)"; exit 2; }
import sys
import torch, triton
import lynxkv, lynxkv.kernels.encode, lynxkv.kernels.decode
print(f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, "
      f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NONE'}, lynxkv from {lynxkv.__file__}")
assert sys.argv[1] == "1" or torch.cuda.is_available(), "no CUDA device visible"
PY
[ "$DRY" = "1" ] || nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>/dev/null || true

if [ "$DRY" = "1" ]; then SELECT=(-k "interp and T1 and default"); else SELECT=(-m cuda); fi
echo "== kernel tests (${SELECT[*]})"
timeout 170 "$PY" -m pytest -q "${SELECT[@]}" "$REPO/tests/test_kernels.py" -c "$REPO/pyproject.toml" \
    --rootdir "$REPO" -p no:cacheprovider -o addopts="" --junitxml="$OUT_DIR/gpu_tests.xml"
TESTS=$?

echo "== GPU benchmark (Llama-3-8B shape: 32 layers x K,V, 8 KV heads, head_dim 128)"
if [ "$DRY" = "1" ]; then
    BENCH_ARGS=(--dry-run-cpu --tokens 40 --layers 1 --heads 2 --head-dim 16)
else
    BENCH_ARGS=(--tokens 1024 8192)
fi
timeout 170 "$PY" "$REPO/benchmarks/bench_gpu.py" "${BENCH_ARGS[@]}" --json "$OUT_DIR/gpu_bench.json"
BENCH=$?

echo "== done: tests rc=$TESTS, benchmark rc=$BENCH; log $LOG, results $OUT_DIR/gpu_bench.json"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
