#!/usr/bin/env bash
# CI for the Python package (python/): builds the extension with maturin from PyPI into a virtual
# environment, installs NumPy and pytest there, and runs python/tests.
#
# The build is a development one and shares target/ with the workspace, so after
# `cargo test --workspace` only the RustyTorch crates and pyo3 compile (about 2 minutes on 2
# cores). `pip install ./python` makes an optimized wheel instead (about 5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
venv=$root/target/ci-python-venv
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" "numpy>=2.1" pytest

echo "== maturin develop (python/)"
VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH CARGO_TARGET_DIR=$root/target \
    maturin develop --manifest-path python/Cargo.toml --profile dev --quiet

echo "== pytest python/tests"
"$venv/bin/python" -m pytest -q python/tests
