#!/usr/bin/env bash
# Reproduces the H200 rows of the benchmark tables (README "Benchmarks",
# docs/BENCHMARKS.md), in parts that each fit one 10-minute device call.
#
# The GPU machine lacks RocksDB, liburing and libfuse3: build on a Debian 12
# machine and carry the binaries with their libraries (docs/BENCHMARKS.md
# "Machines and how to run"):
#   tools/device/pack.sh CARRY build/default/tools/optstate-bench build/default/mount/optstate-mount \
#       build/default/tests/memmgr/memmgr_gpu_test "$(command -v fio)"
#   cp -L build/default/capi/liboptstate.so.1 CARRY/lib/      # the Python parts
# then on the machine, from the repository root:
#   bash tools/device/h200_bench.sh CARRY OUT PART
# PART:
#   step     the io engine against fio; the 8 GiB step from disk against the I/O floor and the
#            miles' streaming with its page cache cold
#   loop     the 8 GiB step with a 10 GiB RAM tier in a loop of 5 s forward/backward: exposed step
#            against miles' NVMe streaming with its page cache warm
#   moments  bf16 and q8 moments against f32 (no RAM tier, interleaved rounds); bf16 moments against
#            miles' NVMe streaming with bf16 moments, without and with a RAM tier
#   quality  GPT-2 124M, 300 steps: final loss with f32, bf16 and q8 moments and torch's AdamW
#            (python/bench/moment_quality.py; writes OUT/quality.json and OUT/quality.svg)
#   reshard  optstate-reshard 4 -> 3 ranks, 4 GiB, column and row split, against fio
#   fast     the step on tmpfs (/dev/shm, O_DIRECT): a device faster than the pipeline
#   rest     the step from a host cache holding the state, sleep/wake, cp -r from the mount,
#            memmgr_gpu_test
# Each command's log goes to OUT/NAME.log and its last lines to OUT/summary.txt; W (default
# /root/osb) is the scratch directory on the machine's disk, emptied after each command.
set -uo pipefail
C=$(cd "$1" && pwd); OUTD=$2; PART=${3:-step}; W=${W:-/root/osb}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PATH=$C/bin:$PATH LD_LIBRARY_PATH=$C/lib OPTSTATE_LOG_LEVEL=warn OPTSTATE_NO_PROGRESS=1
mkdir -p "$W" "$OUTD"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r; nproc; df -h "$W" | tail -1
  cat /sys/block/*/queue/max_sectors_kb 2>/dev/null | head -1; date -u; } > "$OUTD/env-$PART.txt" 2>&1
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" | tee -a "$OUTD/summary.txt"
  timeout "$t" "$@" > "$OUTD/$name.log" 2>&1; echo "rc=$?" >> "$OUTD/$name.log"
  tail -n 14 "$OUTD/$name.log" >> "$OUTD/summary.txt"; rm -rf "${W:?}"/*; }
STEP=(step --dir "$W" --state 8G --budget 2G --backend cuda)
case $PART in
  step)
    run io 150 optstate-bench io --dir "$W" --size 2G --chunk-sizes 8M --rounds 3
    run step 300 optstate-bench "${STEP[@]}" --rounds 2 --host-cache-bytes 0 --baselines cold
    ;;
  loop)
    run loop 500 optstate-bench "${STEP[@]}" --rounds 3 --host-cache-bytes 10G --baselines warm --no-fio \
        --prefetch 5
    ;;
  moments)
    run moments 300 optstate-bench "${STEP[@]}" --rounds 3 --host-cache-bytes 0 --baselines none \
        --bf16-moments --q8-moments
    run bf16_miles 200 optstate-bench "${STEP[@]}" --rounds 2 --host-cache-bytes 0 --no-fio \
        --baselines warm,cold --miles-moments bf16 --bf16-moments
    ;;
  moments_loop)
    run bf16_miles_loop 500 optstate-bench "${STEP[@]}" --rounds 2 --host-cache-bytes 10G --no-fio \
        --prefetch 5 --baselines warm,cold --miles-moments bf16 --bf16-moments
    ;;
  quality)
    OPTSTATE_LIB=$C/lib/liboptstate.so.1 PYTHONPATH=$REPO/python \
      run quality 580 python3 "$REPO/python/bench/moment_quality.py" --steps 300 --torch --dir "$W" \
        --json "$OUTD/quality.json" --svg "$OUTD/quality.svg"
    ;;
  reshard)
    run reshard_columns 280 optstate-bench reshard --dir "$W" --size 4G --rounds 3 --split columns
    run reshard_rows 280 optstate-bench reshard --dir "$W" --size 4G --rounds 3 --split rows
    ;;
  fast)
    M=/dev/shm/optstate-fast; mkdir -p "$M"; df -h /dev/shm | tail -1 >> "$OUTD/env-$PART.txt"
    W=$M run step_fast 170 optstate-bench step --dir "$M" --state 4G --budget 2G --backend cuda --rounds 3
    rm -rf "$M"
    ;;
  rest)
    run step_cache 100 optstate-bench step --dir "$W" --state 6G --hidden 4096 --budget 2G --backend cuda \
        --host-cache-bytes 8G --durable-every 100 --rounds 5 --no-fio --no-baselines
    run sleep 60 optstate-bench sleep --dir "$W" --budget 2G --backend cuda --rounds 5
    run mount 130 optstate-bench mount --dir "$W" --state 3G --rounds 3
    run mount_mix 70 optstate-bench mount --dir "$W" --hidden 1024 --state 1G --rounds 3
    run mount_4096 100 optstate-bench mount --dir "$W" --hidden 4096 --state 2G --rounds 3
    [ -x "$C/bin/memmgr_gpu_test" ] && run gpu_test 150 memmgr_gpu_test
    ;;
  *) echo "unknown part '$PART' (step, loop, moments, moments_loop, quality, reshard, fast, rest)" >&2; exit 2 ;;
esac
