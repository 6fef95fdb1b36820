#!/usr/bin/env bash
# One command on a CUDA machine proves lynxkv's whole path on the GPU and times it, in at most GPU_CHECK_BUDGET_S
# seconds (default 290: under 5 minutes of device time). Writes $OUT/gpu_check.json and $OUT/gpu_check.md (and
# every step's log and result under $OUT/gpu_check/); $OUT defaults to ./out.
#
#   bash benchmarks/gpu_check.sh                       # on the GPU machine, from the repository root
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh       # the same steps at toy sizes on a CPU (~30-60 s)
#
# Steps, each under its own time limit (`timeout`, never more than what is left of the budget); a failed or timed
# out step is recorded and the next one runs. The kernel tests go last: their time (Triton compiling) is the least
# predictable, and the budget must not run out before the path's own measurements. Estimates are for one H100 SXM
# (3.35 TB/s HBM3, ~990 dense BF16 TFLOP/s, PCIe 5 x16 ~50 GB/s host to device) with the Llama-3-8B KV shape
# (32 layers x K,V x 8 KV heads x 128): 128 KiB of BF16 KV per token, 1.07 GB at 8K tokens, 4.3 GB at 32K; the
# 4+4 codes and their metadata are ~0.53 of that (0.57 / 2.3 GB), the anchor alone ~0.27.
#
#   env        (limit 30 s, ~5-10 s) versions, card, imports (torch, triton, transformers, safetensors, pytest).
#   codec      (limit 60 s, ~15-25 s) bench_gpu.py at 8K and 32K: the Triton encode and decodes against a
#              device-to-device copy. Copying 4.3 GB moves 8.6 GB: ~3.5 ms at ~2.5 TB/s; encode and decode move
#              ~1.5x the BF16 bytes, ~3-5 ms each near copy bandwidth; do_bench repeats each for 0.2 s. The torch
#              reference (fp32 intermediates, ~10 passes over 17 GB of fp32) takes ~0.1-0.3 s a call, 3 calls,
#              and may run out of memory at 32K (recorded; the kernels' numbers are kept).
#   user_path  (limit 60 s, ~20-30 s) save_cache of device tensors (encoded on the GPU by the torch reference: the
#              default scheme's compander is not the Triton encode's; 0.57 / 2.3 GB written to local disk at ~1-2
#              GB/s: ~1-2 s at 32K), load_kv(device="cuda") full and anchor-only (the records read from the page
#              cache and CRC-checked on the CPU at ~1-3 GB/s, ~1 s at 32K, then 2.3 GB to the device at ~10-25 GB/s
#              from pageable memory, ~0.1-0.2 s; a layer's full pages decode in one launch, ~0.1 ms), against
#              safetensors save (4.3 GB: ~2-4 s), load and .to("cuda") (~1-2 s); 3 loads of each.
#   runner     (limit 140 s, ~75-100 s) the speculative runner on a random-weight Llama-shaped model (32 layers,
#              hidden 2048, 16 heads, 8 KV heads x 128, MLP 5632, vocab 32768: ~1.6 B parameters, 3.3 GB BF16) at
#              8K and 32K tokens over emulated 10/25/50 Gbit/s links, against the monolithic full code and plain
#              decoding. A decode step reads the weights (3.3 GB: ~1.3 ms) and the KV (1.07 / 4.3 GB: ~0.4 / 1.7
#              ms) at ~2.5 TB/s; its ~3.3 GFLOP of matmuls and 4 x 32 layers x 16 heads x 128 x T of attention
#              (8.6 GFLOP at 32K) are ~10 us at peak, so memory bounds it at ~2-3 ms; but eager transformers
#              launches ~15 kernels a layer from Python: ~10-25 ms a token, so 64 tokens take ~1-1.5 s. The link
#              holds the anchor back by its bytes over the rate and the residual by both: 32K tokens' 2.3 GB at 10
#              Gbit/s is ~1.8 s. Per token count: save and load (~2-8 s), plain decoding, then per rate a Lynx run,
#              a monolithic run and plain decoding of the Lynx run's forward shapes: ~10 runs of ~1-3 s. Then the
#              path users run: `lynxkv run CACHE --model DIR --device cuda` in a process of its own (the progressive
#              reader decoding onto the GPU through pinned buffers, the model loaded there) on the model's first 2
#              layers saved as a directory (~0.7 GB: ~1-2 s to save and to load), at 8K tokens over a link on which
#              the residual takes 0.5 s: imports, CUDA start and model load ~8-15 s, the run ~1-2 s.
#   kernels    (limit 100 s, ~40-90 s) pytest -m cuda of tests/test_kernels.py, tests/test_device_load.py and
#              tests/test_device_run.py (147 tests, small shapes; three of the last run a tiny model on the GPU): the
#              launches take milliseconds; the time is Triton compiling some 50-80 kernel specialisations at
#              ~0.5-1 s each (the cache in ~/.triton is cold on a fresh machine).
#   total      ~2.5-4 minutes, capped at the budget.
#
# lynxkv need not be installed: the script builds a throw-away import root (a temporary directory) whose lynxkv/
# holds links to the repository's lynxkv/ entries and `lynxkv/kernels` to kernels/, and runs every Python command
# from that root, never from the checkout (whose top-level kernels/ must not be importable as `kernels`). It writes
# nothing into the checkout. Needs `python` (or $PYTHON) with torch (CUDA), triton, numpy, pytest, safetensors,
# transformers; a missing one fails the steps that need it, and the report says which.
#
# GPU_CHECK_DRY=1: the same steps and report on a CPU at toy sizes: the Triton kernels under TRITON_INTERPRET=1
# where they run (bench_gpu.py; the kernel tests, among them the load path's batched launches), the compiled CPU
# kernels and the torch reference elsewhere, a tiny fp32 model, links slowed to the toy caches (0.2-1 Mbit/s).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$REPO/out}"
mkdir -p "$OUT_DIR/gpu_check" && OUT_DIR="$(cd "$OUT_DIR" && pwd)"
STEPS="$OUT_DIR/gpu_check"
PY="${PYTHON:-python}"
DRY="${GPU_CHECK_DRY:-0}"
BUDGET="${GPU_CHECK_BUDGET_S:-290}"
START=$SECONDS
rm -f "$STEPS"/*.json "$STEPS"/*.status "$STEPS"/*.log "$STEPS"/*.xml
exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1

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
if [ "$DRY" = "1" ]; then export TRITON_INTERPRET=1; DRYFLAG=(--dry); else unset TRITON_INTERPRET; DRYFLAG=(); fi

# step NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, budget left) seconds, log to $STEPS/NAME.log,
# record "rc seconds limit" in $STEPS/NAME.status (rc 124: timed out; -1: skipped, no budget left).
step() {
    local name="$1" limit="$2" left=$((BUDGET - (SECONDS - START)))
    shift 2
    [ "$left" -lt "$limit" ] && limit="$left"
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped (budget of ${BUDGET}s spent)"
        echo "-1 0 0" > "$STEPS/$name.status"
        return
    fi
    echo "== $name (limit ${limit}s)"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > >(tee "$STEPS/$name.log") 2>&1
    local rc=$?
    echo "$rc $((SECONDS - t0)) $limit" > "$STEPS/$name.status"
    echo "== $name: rc=$rc in $((SECONDS - t0))s"
}

echo "== gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') repo $REPO (dry=$DRY, budget ${BUDGET}s)"
step env 30 "$PY" "$REPO/benchmarks/gpu_check.py" env "${DRYFLAG[@]}" --json "$STEPS/env.json"

if [ "$DRY" = "1" ]; then
    CODEC=(--dry-run-cpu --tokens 40 --layers 1 --heads 2 --head-dim 16)
else
    CODEC=(--tokens 8192 32768)
fi
step codec 60 "$PY" "$REPO/benchmarks/bench_gpu.py" "${CODEC[@]}" --json "$STEPS/codec.json"
step user_path 60 "$PY" "$REPO/benchmarks/gpu_check.py" user-path "${DRYFLAG[@]}" --json "$STEPS/user_path.json"
step runner 140 "$PY" "$REPO/benchmarks/gpu_check.py" runner "${DRYFLAG[@]}" --json "$STEPS/runner.json"

if [ "$DRY" = "1" ]; then
    TESTS=(-k "interp and T1 and default and not compiles" "$REPO/tests/test_kernels.py"
           "$REPO/tests/test_device_load.py::test_device_path_launches_the_triton_kernels_under_the_interpreter")
else
    TESTS=(-m cuda "$REPO/tests/test_kernels.py" "$REPO/tests/test_device_load.py" "$REPO/tests/test_device_run.py")
fi
step kernels 100 "$PY" -m pytest -q "${TESTS[@]}" -c "$REPO/pyproject.toml" --rootdir "$REPO" \
    -p no:cacheprovider -o addopts="" --junitxml="$STEPS/kernels.xml"

"$PY" "$REPO/benchmarks/gpu_check.py" report "${DRYFLAG[@]}" --steps "$STEPS" --json "$OUT_DIR/gpu_check.json" \
    --markdown "$OUT_DIR/gpu_check.md"
REPORT=$?
echo "== done in $((SECONDS - START))s: $OUT_DIR/gpu_check.json, $OUT_DIR/gpu_check.md (rc=$REPORT)"
exit $REPORT
