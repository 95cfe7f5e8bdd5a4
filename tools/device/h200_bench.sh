#!/usr/bin/env bash
# The benchmark run on the H200 machine (issue 8): binaries packed into .carry
# by tools/device/pack.sh (+ a static fio and fusermount3), results into $OUT.
#   bash tools/device/h200_bench.sh .carry $OUT
set -uo pipefail
C=$(cd "$1" && pwd); OUTD=$2; W=${W:-/root/osb}
export PATH=$C/bin:$PATH LD_LIBRARY_PATH=$C/lib OPTSTATE_LOG_LEVEL=warn OPTSTATE_NO_PROGRESS=1
mkdir -p "$W" "$OUTD"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r; nproc; df -h "$W" | tail -1; date -u; } > "$OUTD/env.txt" 2>&1
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" | tee -a "$OUTD/summary.txt"
  timeout "$t" "$@" > "$OUTD/$name.log" 2>&1; echo "rc=$?" >> "$OUTD/$name.log"
  tail -n 25 "$OUTD/$name.log" >> "$OUTD/summary.txt"; rm -rf "${W:?}"/*; }
run io 300 optstate-bench io --dir "$W" --size 2G --chunk-sizes 2M,8M,16M --rounds 3
run step 320 optstate-bench step --dir "$W" --state 8G --budget 2G --backend cuda --rounds 5
run step_cache 150 optstate-bench step --dir "$W" --state 6G --hidden 4096 --budget 2G --backend cuda --host-cache-bytes 8G --durable-every 100 --rounds 5 --no-fio --no-first-version
run sleep 60 optstate-bench sleep --dir "$W" --budget 2G --backend cuda --rounds 5
run mount 150 optstate-bench mount --dir "$W" --state 3G --rounds 3
