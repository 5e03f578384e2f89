#!/usr/bin/env bash
# The one-shot check of the CPU kernels on a machine whose CPU has more than AVX2 (AVX-512,
# AVX512-BF16, AMX), with torch preinstalled and nothing to download (wheels the machine
# lacks, such as llguidance, can be brought in .whl/, as for bench/gpu_check.sh):
#
#   bash bench/isa_check.sh
#
# 1. prints the CPU, its flags and the ISA level the engine picks (rtp_serve/kernels/isa.py);
# 2. installs the project without dependencies and compiles every kernel build in place (kernels/cpu_build.py: avx2 and avx512);
# 3. runs the kernel tests at the CPU's own level, then capped at avx512 and avx2
#    (RTP_SERVE_ISA), so that every build and every forced fallback runs on this CPU;
# 4. runs bench/gemm.py (the GEMM efficiency curve, fp32) at 2 threads (as the 2-core
#    development machines run it) at the CPU's own level and at avx2, then at every core;
# 5. runs bench/engine.py's offline workload in fp32 and bf16 at every core.
# Each stage has its own time limit, so the whole stays under 10 minutes; a failed or
# timed-out stage makes the exit status non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export RTP_SERVE_MODEL_CACHE=${RTP_SERVE_MODEL_CACHE:-/tmp/rtp-serve-models}
started=$SECONDS
status=0
stage() {  # stage NAME LIMIT_S CMD...: runs CMD under a time limit, records a failure
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" -eq 0 ] || status=1
}

echo "== cpu"
lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket|MHz' || true
grep -o -w -E 'amx_bf16|amx_int8|avx512_bf16|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '
echo
hardware=$("$PYTHON" -c "from rtp_serve.kernels.isa import cpu_isa; print(cpu_isa().hardware)")
"$PYTHON" -c "import torch; from rtp_serve.kernels.isa import cpu_isa
print('torch', torch.__version__, '| isa', cpu_isa().describe())"

if compgen -G ".whl/*.whl" >/dev/null; then  # wheels someone brought (llguidance: no index here)
  "$PYTHON" -m pip install -q --no-index --no-deps .whl/*.whl || echo "isa_check: .whl/ install failed"
fi
# The package maps engine/ and services/ into rtp_serve (setup.py): install it in place,
# without dependencies (the machine's torch) and without the install's own kernel build.
RTP_SERVE_BUILD_KERNELS=0 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || echo "isa_check: pip could not install the project; running from the checkout"
stage "compile every kernel build" 240 env RTP_SERVE_KERNEL_BUILDS=all MAX_JOBS="$(nproc)" \
  "$PYTHON" setup.py -q build_ext --inplace
stage "load every kernel build" 60 "$PYTHON" -c "
import importlib
import torch  # the modules link against its libraries
from rtp_serve.kernels import cpu_build
for build in cpu_build.BUILD_FLAGS:
    m = importlib.import_module('rtp_serve.kernels.' + cpu_build.module_name(build))
    print(build, 'built against torch', m.torch_version, '| panel width', m.panel_width())"

# The CPU's level, then each lower level with a build or a GEMM path of its own: avx512_bf16
# differs from amx only inside oneDNN, which picks AMX by the hardware, not by our level.
levels=$("$PYTHON" -c "
from rtp_serve.kernels.isa import LEVELS
top = LEVELS.index('$hardware')
print(' '.join(dict.fromkeys(l for l in ('$hardware', 'avx512', 'avx2') if LEVELS.index(l) <= top)))")
for level in $levels; do
  tests=(tests/test_packed_gemm.py tests/test_linear_kernel.py)
  [ "$level" = "$hardware" ] && tests+=(tests/test_attention_kernels.py)
  stage "kernel tests at $level" 150 env RTP_SERVE_ISA="$level" \
    "$PYTHON" -m pytest -q -x -p no:cacheprovider "${tests[@]}"
done

rows=1,2,4,8,16,24,32,48,64,256,1024
for level in "$hardware" avx2; do
  stage "bench/gemm.py at $level, 2 threads" 100 env RTP_SERVE_ISA="$level" \
    "$PYTHON" bench/gemm.py --threads 2 --rows "$rows" --repeats 3
  [ "$hardware" = avx2 ] && break
done
if [ "$(nproc)" -gt 2 ]; then
  stage "bench/gemm.py at $hardware, $(nproc) threads" 100 \
    "$PYTHON" bench/gemm.py --threads "$(nproc)" --rows "$rows" --repeats 3
fi
# The engine offline in fp32 and bf16 at every core (bf16 takes oneDNN's prepacked GEMMs on
# AVX512-BF16 / AMX), HF transformers in the same run.
stage "bench/engine.py fp32,bf16, $(nproc) threads" 120 \
  "$PYTHON" bench/engine.py --configs fp32,bf16 --threads "$(nproc)"
echo "== isa_check: exit $status after $((SECONDS - started)) s"
exit "$status"
