#!/usr/bin/env bash
# Kernels on an H100/H200, in one go: the GPU unit test (CUDA vs CPU), then
# kernels/bench/torch_compare.py (10-step accuracy vs torch's fused Adam/AdamW,
# and the 2^28-element benchmark vs torch and vs device-to-device copy).
#
# Usage (repo root or anywhere): kernels/bench/run_h200.sh [BUILD_DIR] [OUT_DIR]
#   BUILD_DIR  default build/default (the default preset's); should hold tests/kernels/kernels_gpu_test
#              and kernels/liboptstate_kernels_capi.so from a CUDA build. The
#              GPU machine here has nvcc but not the project's other packages,
#              so build on the dev machine and carry both files; when the .so is
#              missing it is built here with nvcc alone, when the test is
#              missing it is reported as not run.
#   OUT_DIR    default $OUT, else /tmp/optstate-kernels-h200: logs, xml, json, md.
# Exit status: nonzero when the test or the accuracy check failed or was not run.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build/default}
out=${2:-${OUT:-/tmp/optstate-kernels-h200}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
  --format=csv 2>&1 | tee "$out/gpu.txt"

lib=$build/kernels/liboptstate_kernels_capi.so
if [ ! -f "$lib" ]; then
  lib=/tmp/optstate-kernels-build/liboptstate_kernels_capi.so
  mkdir -p "$(dirname "$lib")"
  echo "== building $lib with nvcc (no $build/kernels/liboptstate_kernels_capi.so)"
  nvcc -std=c++17 -O3 -fmad=false -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 -I. -shared \
    -Xcompiler -fPIC,-fvisibility=hidden,-fno-math-errno,-ffp-contract=off \
    kernels/adam_cuda.cu kernels/adam_cpu.cc kernels/capi.cc -o "$lib" || exit 1
fi

test_bin=$build/tests/kernels/kernels_gpu_test
if [ -x "$test_bin" ]; then
  echo "== $test_bin"
  start=$(date +%s)
  "$test_bin" --gtest_output="xml:$out/kernels_gpu_test.xml" >"$out/kernels_gpu_test.log" 2>&1
  trc=$?
  grep -E "not bit-identical|Skipped|Failure|FAILED|PASSED|tests ran" "$out/kernels_gpu_test.log" \
    | sort | uniq -c | sort -rn | head -40
  echo "kernels_gpu_test exit $trc in $(( $(date +%s) - start )) s"
  [ $trc -eq 0 ] || status=1
else
  echo "== kernels_gpu_test NOT RUN: $test_bin missing (build it with CUDA and carry it)"
  status=1
fi

echo "== torch_compare.py"
python3 kernels/bench/torch_compare.py --lib "$lib" --out "$out" || status=1
exit $status
