#!/usr/bin/env bash
# Embeds STAGEDIR/sentences.txt with STAGEDIR/model (from `scripts/minilm_gpu_check.py stage`)
# on the CPU in f32 and on CUDA in f32, f16 and bf16, then compares the CUDA results with the CPU
# one (scripts/minilm_gpu_check.py compare). Run from the repository root:
#
#   bash scripts/minilm_gpu_check.sh BIN STAGEDIR OUTDIR     # BIN: the rustytorch binary
set -euo pipefail
if [ $# -ne 3 ]; then
    echo "usage: $0 BIN STAGEDIR OUTDIR" >&2
    exit 2
fi
bin="$1" stage="$2" out="$3"
mkdir -p "$out"
embed() { # DEVICE DTYPE OUTFILE
    local start
    rm -f "$3"
    start=$(date +%s.%N)
    if "$bin" embed --model "$stage/model" --device "$1" --dtype "$2" \
        --file "$stage/sentences.txt" --batch 16 --out "$3"; then
        awk -v a="$start" -v b="$(date +%s.%N)" -v what="$1 $2" -v f="$3" \
            'BEGIN { printf "%-9s %6.2f s -> %s\n", what, b - a, f }'
    else
        echo "$1 $2 FAILED" >&2
    fi
}
embed cpu f32 "$out/cpu_f32.npy"
for dt in f32 f16 bf16; do
    embed cuda "$dt" "$out/cuda_$dt.npy"
done
python3 scripts/minilm_gpu_check.py compare "$out"
