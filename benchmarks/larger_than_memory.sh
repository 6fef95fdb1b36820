#!/usr/bin/env bash
# Caches larger than memory, end to end on the CLI: a Llama-3-70B-shaped BF16 dump (80 layers x 8 KV heads x 128,
# 80K tokens: ~27 GB) written layer by layer, then encode, verify, decode, decode --anchor-only and stream -o, each
# under /usr/bin/time -v (wall, peak RSS), each decoded file checked bit for bit against the cache's own values
# (benchmarks/check_decoded.py, memory bounded by a layer) and removed before the next. The disk holds at most the
# dump and the cache, then the cache and one decoded file (~42 GB at the default size).
#
#   bash benchmarks/larger_than_memory.sh DIR [TOKENS]      (default 81920 tokens)
set -euo pipefail
dir=${1:?usage: larger_than_memory.sh DIR [TOKENS]}; tokens=${2:-81920}
here=$(cd "$(dirname "$0")" && pwd); py=${PYTHON:-$here/../.venv/bin/python}; lynxkv=$(dirname "$py")/lynxkv
mkdir -p "$dir"; cd "$dir"
timed() {  # label, command...: one line "label: wall s, peak RSS MiB"
    local label=$1; shift
    /usr/bin/time -v "$@" > /dev/null 2> time.txt || { cat time.txt >&2; exit 1; }
    awk -v l="$label" '/Elapsed \(wall clock\)/{n=split($NF,t,":"); w=(n==3)?t[1]*3600+t[2]*60+t[3]:t[1]*60+t[2]}
        /Maximum resident/{r=$NF/1024} END{printf "%s: %.1f s, %.0f MiB\n", l, w, r}' time.txt
}
timed "write the dump" "$py" "$here/big_dump.py" kv.safetensors --layers 80 --heads 8 --tokens "$tokens" --dim 128
ls -l kv.safetensors | awk '{printf "dump: %.2f GB\n", $5/1e9}'
timed "python -c pass (the interpreter and torch)" "$py" -c "import torch, lynxkv"
timed "lynxkv encode" "$lynxkv" encode kv.safetensors -o c.lynx
rm kv.safetensors
ls -l c.lynx c.lynxr | awk '{s+=$5} END{printf "cache: %.2f GB\n", s/1e9}'
timed "lynxkv verify" "$lynxkv" verify c.lynx
timed "lynxkv decode" "$lynxkv" decode c.lynx -o back.safetensors
"$py" "$here/check_decoded.py" c.lynx back.safetensors; rm back.safetensors
timed "lynxkv decode --anchor-only" "$lynxkv" decode c.lynx -o anchor.safetensors --anchor-only
"$py" "$here/check_decoded.py" c.lynx anchor.safetensors --anchor-only; rm anchor.safetensors
timed "lynxkv stream -o" "$lynxkv" stream c.lynx -o copy/c.lynx
cmp c.lynx copy/c.lynx && cmp c.lynxr copy/c.lynxr && echo "stream copy: byte-identical"
df -h . | tail -1
