#!/usr/bin/env bash
# Builds the project's two images, rtp-serve-slim and rtp-serve-worker, on any Docker host:
# one with a registry, or an air-gapped one (no registry; packages only from a Debian mirror,
# a PyPI mirror and a local torch wheel), or one behind a TLS-intercepting proxy.
#
#   docker/build-images.sh              # from the repository root; cached layers are reused
#
# Each step is skipped when its input is given. The environment that steers it:
#
#   BASE_IMAGE       a Debian-based image with python3.11 and pip on PATH. Unset: the official
#                    python:3.11-slim where this daemon has it or can pull it, else one built
#                    here from a Debian mirror (debootstrap, then `docker import`), tagged
#                    rtp-serve-python:3.11-bookworm.
#   DEBIAN_MIRROR    for that build (default: the first one in this host's apt sources).
#   EXTRA_CA_DIR     *.crt files the builds must trust (a TLS proxy's CA). Default: this
#                    host's extra CAs, /usr/local/share/ca-certificates. They go into a local
#                    layer over the base (rtp-serve-python:local), on this host only: push
#                    neither that layer nor images built on it anywhere.
#   TORCH_INDEX_URL  where the worker image takes torch (Dockerfile.worker's default: the
#                    PyTorch CPU index). Unset, and a torch wheel of the pinned version in
#                    TORCH_WHEELS (default: pip's find-links, where this machine keeps its CPU
#                    build): a simple index of that wheel and its dependencies is served on
#                    127.0.0.1:${TORCH_INDEX_PORT:-38123} for the build, which then runs
#                    with --network host.
#   DOCKER_BUILDKIT  default 0: the legacy builder, which needs nothing from a registry
#                    (BuildKit would; both build these Dockerfiles).
#   IMAGE_TAG        default latest.
#
# Credentials never go in: pip and apt inside the build reach the same mirrors the host's do
# over their public addresses; only CA certificates are added, and only to the local layer.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '%s build-images: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

TAG="${IMAGE_TAG:-latest}"
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/rtp-serve/docker"
PYTHON_IMAGE=python:3.11-slim
LOCAL_PYTHON=rtp-serve-python:3.11-bookworm
LOCAL_DEBIAN=rtp-serve-debian:bookworm
TORCH_PIN="$(grep -E '^torch==' constraints.txt)"
mkdir -p "$CACHE"

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

host_mirror() {
    # deb822 (.sources) or one-line format; the first Debian archive named.
    sed -n -E 's#^(URIs:|deb)[[:space:]]+(\[[^]]*\][[:space:]]+)?(https?://[^[:space:]]+/debian)/?([[:space:]].*)?$#\3#p' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n1
}

# -- 1. the base: python:3.11-slim, or its stand-in from a Debian mirror ----------------------
local_base() {
    if ! have_image "$LOCAL_DEBIAN"; then
        command -v debootstrap >/dev/null || { log "no registry and no debootstrap: apt-get install -y debootstrap"; exit 1; }
        local mirror="${DEBIAN_MIRROR:-$(host_mirror)}"
        mirror="${mirror:-http://deb.debian.org/debian}"
        local root
        root="$(mktemp -d)"
        log "debootstrap bookworm from $mirror"
        debootstrap --variant=minbase bookworm "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 \
            || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
        tar -C "$root" -c . | docker import - "$LOCAL_DEBIAN" >/dev/null
        rm -rf "$root"
    fi
    if ! have_image "$LOCAL_PYTHON"; then
        log "building $LOCAL_PYTHON on $LOCAL_DEBIAN"
        # Debian's python3 in a venv at /usr/local, so `python` and `pip` are on PATH and pip
        # may install (Debian's own interpreter is externally managed), as in the official
        # image; python3-dev for the worker's kernel build.
        docker build -q -t "$LOCAL_PYTHON" - >/dev/null <<EOF
FROM $LOCAL_DEBIAN
RUN apt-get update -qq \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \\
      python3 python3-venv python3-dev ca-certificates \\
 && python3 -m venv /usr/local \\
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8
EOF
    fi
    echo "$LOCAL_PYTHON"
}

pick_base() {
    if [ -n "${BASE_IMAGE:-}" ]; then echo "$BASE_IMAGE"; return; fi
    if have_image "$PYTHON_IMAGE" || timeout 30 docker pull -q "$PYTHON_IMAGE" >/dev/null 2>&1; then
        echo "$PYTHON_IMAGE"; return
    fi
    log "no $PYTHON_IMAGE (no registry reachable): building a stand-in from a Debian mirror"
    local_base
}

# -- 2. extra CA certificates, in a layer that stays on this host -----------------------------
with_cas() {
    local base="$1" dir="${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}"
    local certs=()
    [ -d "$dir" ] && mapfile -t certs < <(find "$dir" -maxdepth 1 -name '*.crt' | sort)
    if [ "${#certs[@]}" -eq 0 ]; then echo "$base"; return; fi
    local ctx
    ctx="$(mktemp -d)"
    cp "${certs[@]}" "$ctx/"
    log "trusting ${#certs[@]} extra CA certificate(s) from $dir (local layer rtp-serve-python:local)"
    # ca-certificates is in the official image and in the stand-in; update-ca-certificates
    # folds the extras into the bundle pip (PIP_CERT) and everything else reads.
    cat >"$ctx/Dockerfile" <<EOF
FROM $base
COPY *.crt /usr/local/share/ca-certificates/
RUN update-ca-certificates >/dev/null
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt
EOF
    docker build -q -t rtp-serve-python:local "$ctx" >/dev/null
    rm -rf "$ctx"
    echo rtp-serve-python:local
}

# -- 3. torch: a local simple index of the pinned CPU wheel and its dependencies --------------
INDEX_PID=""
LOCAL_INDEX_URL=""
cleanup() { [ -n "$INDEX_PID" ] && kill "$INDEX_PID" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 130' INT TERM # so that EXIT's cleanup runs on a signal too

local_torch_index() {
    local wheels="${TORCH_WHEELS:-$(pip config get global.find-links 2>/dev/null || true)}"
    wheels="${wheels:-${PIP_FIND_LINKS:-}}"
    local version="${TORCH_PIN#torch==}"
    local wheel
    wheel="$(find ${wheels:+"$wheels"} -maxdepth 1 -name "torch-${version}+cpu-cp311-*.whl" 2>/dev/null | head -n1 || true)"
    [ -n "$wheel" ] || return 1
    local dir="$CACHE/torch-index" files="$CACHE/torch-index/files"
    mkdir -p "$files"
    if [ ! -e "$dir/complete" ]; then
        log "local torch index: $(basename "$wheel") and its dependencies"
        cp "$wheel" "$files/"
        # Its dependencies from whatever index this host's pip uses (PyPI, or a mirror).
        python3 -m pip download -q --only-binary=:all: --dest "$files" --find-links "$files" \
            "$TORCH_PIN" >&2
        touch "$dir/complete"
    fi
    # PEP 503: /simple/<normalized project>/ lists its files.
    python3 - "$dir" <<'EOF'
import re, sys
from pathlib import Path
root = Path(sys.argv[1]); files = root / "files"; simple = root / "simple"
by_project = {}
for f in sorted(files.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", f.name.split("-")[0]).lower()
    by_project.setdefault(name, []).append(f.name)
for name, names in by_project.items():
    (simple / name).mkdir(parents=True, exist_ok=True)
    links = "".join(f'<a href="../../files/{n}">{n}</a>\n' for n in names)
    (simple / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
EOF
    # A fixed port, so the build argument, and with it the cache of every layer after it, is
    # the same from one build to the next (a random one rebuilt torch's layers each time).
    local port="${TORCH_INDEX_PORT:-38123}"
    # SO_REUSEADDR, as http.server binds: the last build's connections in TIME_WAIT on the
    # port do not make it taken.
    if ! python3 -c "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', $port))" 2>/dev/null; then
        log "port $port is taken: a free one (the torch layers will not come from the cache)"
        port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    fi
    python3 -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >"$CACHE/index.log" 2>&1 &
    INDEX_PID=$!
    for _ in $(seq 50); do
        python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/simple/torch/')" 2>/dev/null && break
        sleep 0.1
    done
    LOCAL_INDEX_URL="http://127.0.0.1:$port/simple"
}

BASE="$(with_cas "$(pick_base)")"
NETWORK=()
TORCH_ARGS=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
elif local_torch_index; then # not in a $(...) subshell: cleanup must see INDEX_PID
    TORCH_ARGS=(--build-arg "TORCH_INDEX_URL=$LOCAL_INDEX_URL")
    NETWORK=(--network host) # the index listens on the host's loopback
fi

for image in slim worker; do
    start=$(date +%s)
    extra=()
    [ "$image" = worker ] && extra=("${TORCH_ARGS[@]}")
    log "rtp-serve-$image:$TAG on $BASE"
    docker build "${NETWORK[@]}" -f "docker/Dockerfile.$image" --build-arg "BASE_IMAGE=$BASE" \
        "${extra[@]}" -t "rtp-serve-$image:$TAG" . >"$CACHE/build-$image.log" 2>&1 \
        || { tail -n 40 "$CACHE/build-$image.log" >&2; exit 1; }
    log "rtp-serve-$image:$TAG built in $(($(date +%s) - start)) s ($(docker image inspect -f '{{.Size}}' "rtp-serve-$image:$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
done
