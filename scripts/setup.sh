#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine (as root) and fast when done:
#   1. a virtualenv in .venv with the package (editable) and its test, vLLM and bench
#      extras (torch by pip from the machine's CPU wheel, the rest by uv from its shared
#      cache);
#   2. a running Docker engine (installs docker.io and debootstrap when missing), and
#      nginx and chromium for the tests (not started);
#   3. the sandbox base image (built from a Debian root filesystem, cached by recipe).
# Each step is skipped when its stamp or probe says it is already in place.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${FLEETRL_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
UV_VERSION=0.13.9
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
    # torch is pinned and fetched by pip, which takes the machine's CPU wheel (its
    # configured find-links) where another installer could pull a CUDA build of several GB.
    wheels=$(mktemp -d)
    trap 'rm -rf "$wheels"' EXIT
    "$VENV/bin/pip" download -q --no-deps -d "$wheels" "torch==2.13.0"
    torch_wheel=$(ls "$wheels"/torch-*.whl)
    torch_version=$(basename "$torch_wheel" | cut -d- -f2)
    # uv installs that wheel and everything else (about 3.5 GB with vLLM's CPU build) by
    # linking files from its shared cache (~/.cache/uv): a second clone's virtualenv takes
    # seconds where pip took minutes (docs/results/tiny-run.md, session 9).
    "$VENV/bin/pip" install -q "uv==$UV_VERSION"
    uv=("$VENV/bin/uv" pip --quiet)
    "${uv[@]}" install --python "$VENV/bin/python" "$torch_wheel" -e ".[test,vllm,bench,s3]"
    # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
    "${uv[@]}" uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec 2>/dev/null || true
    now=$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.__version__)')
    if [[ $now != "$torch_version" ]]; then
        log "torch is $now, not $torch_version from $torch_wheel: a dependency replaced it"; exit 1
    fi
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
# nginx: the HTTP cache of the delta fan-out tests (tests/weights/test_fanout.py); not started here
if ! command -v nginx >/dev/null 2>&1 && [[ ! -x /usr/sbin/nginx ]]; then
    log "installing nginx (the weight fan-out tests' cache)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq nginx-light >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq nginx-light >/dev/null; }
fi
# chromium: the headless browser of the dashboard tests (tests/dashboard/test_browser.py)
if ! command -v chromium >/dev/null 2>&1; then
    log "installing chromium (the dashboard tests' browser)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq; apt-get install -y -qq chromium >/dev/null; }
fi

# --- 3. sandbox image (cached by recipe hash; a no-op when unchanged) ----------
if "$VENV/bin/fleetrl" sandbox --help >/dev/null 2>&1; then
    "$VENV/bin/fleetrl" sandbox build-image >&2
fi
log "ready"
