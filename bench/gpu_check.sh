#!/usr/bin/env bash
# The one-shot GPU check (issue 15), on a CUDA machine with torch and triton preinstalled
# and nothing to download:
#
#   bash bench/gpu_check.sh [--real-model DIR] [--quick]
#
# 1. installs this project without dependencies (torch and triton are the machine's; wheels
#    in .whl/, if someone brought some, are installed the same way);
# 2. runs the Triton kernel tests and the backend/graph tests on CUDA;
# 3. runs bench/gpu_check.py: greedy parity with HF on CUDA, kernel timings against the
#    torch reference, decode (batch 1/16/128, eager and CUDA graphs) and prefill tokens/s
#    against rooflines measured in the same run; one table.
# Each stage has its own time limit, so the whole stays under 8 minutes. Both stages always
# run; a failed (or timed-out) test, or a parity mismatch, makes the exit status non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
started=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, even if pip cannot install it

"$PYTHON" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device')" \
  || { echo "gpu_check: needs torch with CUDA and triton" >&2; exit 1; }

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps .whl/*.whl || echo "gpu_check: .whl/ install failed"
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || echo "gpu_check: pip could not install the project; running from the checkout"
missing=$("$PYTHON" - <<'PY'
import importlib.util
need = ["safetensors", "tokenizers", "jinja2", "numpy", "transformers", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
PY
)
[ -n "$missing" ] && echo "gpu_check: missing here (the stages needing them will say so): $missing"

echo "== kernel tests on CUDA"
timeout 150 "$PYTHON" -m pytest -q -p no:cacheprovider \
  tests/test_triton_kernels.py tests/test_backends.py tests/test_cuda_graphs.py 2>&1 | tail -15
tests_status=${PIPESTATUS[0]}  # pytest's (or timeout's), not tail's
[ "$tests_status" -ne 0 ] && echo "gpu_check: kernel tests FAILED (status $tests_status)"

echo "== parity, kernel timings, decode and prefill speed"
timeout $((470 - (SECONDS - started))) "$PYTHON" bench/gpu_check.py "$@"
check_status=$?
[ "$check_status" -ne 0 ] && echo "gpu_check: bench/gpu_check.py FAILED (status $check_status)"
echo "gpu_check: $((SECONDS - started)) s"
[ "$tests_status" -eq 0 ] && [ "$check_status" -eq 0 ]
