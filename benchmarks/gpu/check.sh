#!/usr/bin/env bash
# The GPU check, ready to run on a machine with one NVIDIA GPU (an H200 here: torch,
# transformers, typer and rich preinstalled, no network). From the repository root:
#
#   bash benchmarks/gpu/check.sh [OUT_DIR]            # on the GPU: under 8 minutes on one H200
#   DEVICE=cpu SMALL=1 bash benchmarks/gpu/check.sh DIR  # the same path on this machine's CPU (minutes)
#   DEVICE=cpu TINY=1 bash benchmarks/gpu/check.sh DIR   # the test suite's form (under a minute)
#   DEADLINE=420 bash benchmarks/gpu/check.sh OUT          # stop starting stages after 420 s
#   ATTNAUDIT_SHARED_DATA=DIR ...                          # real data (MNIST/) where ../shared/data is absent
#   PRECISIONS=float32,bfloat16 ...                        # malleability and landscape again at these precisions
#                                                          # (the first also for the scale benchmark); empty: none
#
# Each analysis (kappa, ntk-distance, malleability, landscape) runs on the CPU and on DEVICE, then
# benchmarks/bench_scale.py on DEVICE (--small with SMALL=1, skipped with TINY=1);
# timings and the agreement of their numbers (tolerances in benchmarks/gpu/check.py) go to
# OUT_DIR/gpu-check.json ($OUT when no folder is given). Exit 0 when every number agrees.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
DEVICE="${DEVICE:-cuda}"
SIZE=full
[ "${SMALL:-0}" = 1 ] && SIZE=small
[ "${TINY:-0}" = 1 ] && SIZE=tiny
PY="$(command -v python || command -v python3)"
if ! "$PY" -c "import attnaudit" 2>/dev/null; then
  # the device machine has the dependencies and no network: install the project itself only,
  # without an isolated build environment (that would fetch setuptools); if even that fails,
  # run it from the checkout
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . \
    || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
exec "$PY" benchmarks/gpu/check.py --device "$DEVICE" --size "$SIZE" --out "$OUT_DIR" ${DEADLINE:+--deadline "$DEADLINE"} \
  --precisions "${PRECISIONS:-float32,bfloat16}"
