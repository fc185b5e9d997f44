#!/usr/bin/env bash
# The GPU check for a lent GPU machine (issue 19): one call, under 8 minutes.
#
# Here, once (downloads the wheels fleetrl needs beyond that machine's own torch,
# transformers, numpy and numba, for its Python 3.12, into .whl/, which git ignores):
#     bash scripts/gpu_wheels.sh
# Then, through the device tool:
#     run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
#
# There: installs the wheels into /tmp/site without dependencies (nothing replaces the
# machine's torch; pyproject's torch pin is not consulted), makes this checkout
# importable as `fleetrl` (a link, no build), prints the machine, then runs
# bench/gpu_check.py: the trainer and bf16 / fp8 torch samplers of a Qwen3-class model
# on the GPU following the delta stream (see its docstring). The output ends with one
# JSON line; it is also written to $OUT/gpu_check.json when $OUT is set.
# GPU_CHECK_ARGS adds arguments (e.g. "--steps 3 --layers 4").
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-python3}"
site=/tmp/site
mkdir -p "$site"
if compgen -G "$here/.whl/*.whl" > /dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$here"/.whl/*.whl
fi
ln -sfn "$here" "$site/fleetrl"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)"
# shellcheck disable=SC2086
"$py" "$here/bench/gpu_check.py" ${GPU_CHECK_ARGS:-} | tee /tmp/gpu_check.log
if [ -n "${OUT:-}" ]; then
    tail -n 1 /tmp/gpu_check.log > "$OUT/gpu_check.json"
    cp /tmp/gpu_check.log "$OUT/gpu_check.log"
fi
