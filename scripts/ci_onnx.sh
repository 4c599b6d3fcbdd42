#!/usr/bin/env bash
# ONNX conformance for CI: installs the `onnx` package (1.19.1, the last to ship the backend node
# tests) and onnxruntime into a cached virtual environment, builds the runner, and runs ONNX's
# node tests of every op the importer claims (scripts/onnx_conformance.py --check): a test listed
# in scripts/onnx_conformance_passing.txt that fails now fails this script. Then the light_* CNNs
# the package ships and the GPT exported from PyTorch (tests/data/onnx/tiny_gpt.onnx), against
# onnxruntime (scripts/onnx_models.py).
#
#   scripts/ci_onnx.sh
#   RUSTYTORCH_ONNX_VENV=/tmp/venv scripts/ci_onnx.sh
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${RUSTYTORCH_ONNX_VENV:-$HOME/.cache/rustytorch/onnx-venv}"
if ! "$venv/bin/python" -c "import onnx, onnxruntime, numpy; assert onnx.__version__ == '1.19.1'" 2>/dev/null; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        onnx==1.19.1 onnxruntime==1.32.0 numpy==2.4.6
fi
cargo build --quiet --bin rustytorch
"$venv/bin/python" scripts/onnx_conformance.py --check
"$venv/bin/python" scripts/onnx_models.py
