#!/usr/bin/env bash
# Fetches NVIDIA's runtime compiler library (NVRTC, CUDA 13.0, the version the GPU machines run)
# with pip from its PyPI wheel `nvidia-cuda-nvrtc` into a cache folder and prints the folder that
# holds libnvrtc.so.13. NVRTC needs no GPU, so with it on LD_LIBRARY_PATH the tests compile every
# generated CUDA kernel they cover (tests/nvrtc_kernels.rs) on a machine without one:
#
#   export LD_LIBRARY_PATH="$(scripts/fetch_nvrtc.sh):$LD_LIBRARY_PATH" RUSTYTORCH_TEST_NVRTC=1
#
# Fetching again is a no-op.
set -euo pipefail
version=13.0.88
cache="${RUSTYTORCH_NVRTC_DIR:-$HOME/.cache/rustytorch/nvrtc-$version}"
lib="$cache/nvidia/cu13/lib"
if [ -f "$lib/libnvrtc.so.13" ]; then
    echo "$lib"
    exit 0
fi
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --dest "$tmp" "nvidia-cuda-nvrtc==$version" >&2
python3 - "$tmp" "$cache" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/nvidia_cuda_nvrtc-*.whl")[0]
zipfile.ZipFile(wheel).extractall(sys.argv[2])
PY
echo "$lib"
