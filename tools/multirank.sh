#!/usr/bin/env bash
# multirank.sh: N ranks on one node, each owning two optimizer stores
# (rankNNNN.dense, rankNNNN.expert) under one store root; one optstate-mount for
# the node; every rank snapshots the same step; `cp -r MOUNT/*/snapshots/NAME`
# into a checkpoint dir per store; restore every store into a fresh store;
# verify bit for bit (cmp of every file against the restored store's latest/
# served by a second mount, identical tensor files across ranks, inspect verify);
# fio with one job per rank on the same filesystem for the aggregate comparison.
#
#   tools/multirank.sh --bin BUILD/tools --root DIR [--ranks 8] --params-per-rank N
#                      --steps K --budget BYTES [--backend host|cuda] [--chunk-size 8M]
#                      [--tensors T] [--store-mode seq|par] [--mount MOUNTPOINT]
#                      [--out LOGDIR] [--no-fio] [--keep]
#
# --bin: directory holding optstate-bench, optstate-restore, optstate-inspect and
#   optstate-mount (optstate-mount is also looked for in BIN/../mount and on PATH).
# --params-per-rank N: split over the rank's two stores (dense N/2, expert the
#   rest); state is 12 B/param. --budget is per store (per optimizer instance).
# --store-mode: how a rank runs its two optimizer instances. optstate-bench step
#   drives one store per process, so a rank is a subshell running two bench
#   processes: `seq` (default) runs dense then expert (as one process stepping
#   two optimizers would, one after the other), `par` runs them at once.
# Disk needed: about 2x the state (copy-on-write of the last step) + 1x for the
#   checkpoint copy + 1x for the restored stores, plus fio's files (1x state).
# Exit status: 0 only if every rank succeeded and every check matched.
set -euo pipefail

BIN="" ROOT="" RANKS=8 PPR="" STEPS="" BUDGET="" BACKEND=host CHUNK=8M TENSORS=4
MODE=seq MNT="" OUT="" NO_FIO=0 KEEP=0
usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bin) BIN=$2; shift 2 ;;
    --root) ROOT=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --params-per-rank) PPR=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --chunk-size) CHUNK=$2; shift 2 ;;
    --tensors) TENSORS=$2; shift 2 ;;
    --store-mode) MODE=$2; shift 2 ;;
    --mount) MNT=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --no-fio) NO_FIO=1; shift ;;
    --keep) KEEP=1; shift ;;
    -h|--help) usage ;;
    *) echo "multirank: error: unknown argument '$1'" >&2; usage ;;
  esac
done
die() { echo "multirank: error: $*" >&2; exit 1; }
[[ -n $BIN && -n $ROOT && -n $PPR && -n $STEPS && -n $BUDGET ]] ||
  { echo "multirank: error: --bin, --root, --params-per-rank, --steps, --budget are required" >&2; usage; }
[[ $MODE == seq || $MODE == par ]] || die "--store-mode must be seq or par, got '$MODE'"
[[ $PPR =~ ^[0-9]+$ && $PPR -ge 2 ]] || die "--params-per-rank must be an integer >= 2, got '$PPR'"
BENCH=$BIN/optstate-bench RESTORE=$BIN/optstate-restore INSPECT=$BIN/optstate-inspect
MOUNTBIN=""
for c in "$BIN/optstate-mount" "$BIN/../mount/optstate-mount" "$(command -v optstate-mount || true)"; do
  [[ -n $c && -x $c ]] && { MOUNTBIN=$c; break; }
done
for b in "$BENCH" "$RESTORE" "$INSPECT" "$MOUNTBIN"; do
  [[ -n $b && -x $b ]] || die "binary missing or not executable: '${b:-optstate-mount}' (--bin $BIN)"
done
command -v fusermount3 >/dev/null || die "fusermount3 not on PATH"
[[ $NO_FIO == 1 ]] || command -v fio >/dev/null || die "fio not on PATH (or pass --no-fio)"

# Sizes in bytes (binary units, like the tools).
to_bytes() {
  local v=$1 m=1
  case "$v" in *[kK]) m=1024; v=${v%?} ;; *[mM]) m=$((1 << 20)); v=${v%?} ;;
    *[gG]) m=$((1 << 30)); v=${v%?} ;; esac
  awk -v v="$v" -v m="$m" 'BEGIN { printf "%d", v * m }'
}
CHUNK_B=$(to_bytes "$CHUNK")
DENSE=$((PPR / 2)) EXPERT=$((PPR - PPR / 2))
SNAP="step$STEPS"
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
[[ -z $OUT ]] && OUT=$ROOT/logs
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STORES=$ROOT/stores CKPT=$ROOT/checkpoint REST=$ROOT/restored FIODIR=$ROOT/fio
[[ -z $MNT ]] && MNT=$ROOT/mnt
MNT2=$ROOT/mnt-restored
for d in "$STORES" "$CKPT" "$REST" "$FIODIR"; do
  [[ ! -e $d ]] || die "$d exists; use a fresh --root (stores would be continued, not created)"
done
mkdir -p "$STORES" "$CKPT" "$REST" "$MNT" "$MNT2"
export OPTSTATE_NO_PROGRESS=1 OPTSTATE_LOG_LEVEL=${OPTSTATE_LOG_LEVEL:-warn}

MOUNT_PIDS=() RANK_PIDS=() SMI_PID=""
cleanup() {
  local rc=$?
  set +e
  for p in "${RANK_PIDS[@]}" $SMI_PID; do kill "$p" 2>/dev/null; done
  if [[ ${#RANK_PIDS[@]} -gt 0 ]]; then  # failed mid-step: stop the bench processes too
    for f in "$OUT"/rank*.pid; do [[ -f $f ]] && kill "$(cat "$f")" 2>/dev/null; done
  fi
  for m in "$MNT" "$MNT2"; do
    mountpoint -q "$m" 2>/dev/null && { fusermount3 -u "$m" 2>/dev/null || fusermount3 -u -z "$m"; }
  done
  for p in "${MOUNT_PIDS[@]}"; do
    kill "$p" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
  done
  if [[ $KEEP == 0 && $rc == 0 ]]; then
    rm -rf "$STORES" "$CKPT" "$REST" "$FIODIR"
    rmdir "$MNT" "$MNT2" 2>/dev/null
  fi
  [[ $rc == 0 ]] || echo "multirank: FAILED (exit $rc); logs in $OUT" >&2
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

now() { date +%s.%N; }
jget() { sed -n "s/^ *\"$1\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" "$2" | head -1; }
# Mounts STORE_ROOT at MOUNTPOINT in the background, waits until it is served.
start_mount() {
  local root=$1 mnt=$2 log=$3
  "$MOUNTBIN" "$root" "$mnt" -f >"$log" 2>&1 &
  MOUNT_PIDS+=($!)
  local pid=$!
  for _ in $(seq 300); do
    mountpoint -q "$mnt" && return 0
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; die "optstate-mount $root $mnt exited early"; }
    sleep 0.1
  done
  die "optstate-mount $root $mnt: not mounted after 30 s"
}

rank_name() { printf 'rank%04d' "$1"; }
echo "multirank: $RANKS ranks x 2 stores (dense $DENSE + expert $EXPERT params, $TENSORS tensors" \
     "each), $STEPS steps, budget $BUDGET per store, chunk $CHUNK, backend $BACKEND, store mode $MODE"
echo "multirank: root $ROOT, mount $MNT, logs $OUT"

# 1. Stepping phase: all ranks at once.
run_store() {  # rank kind params
  local s; s=$(rank_name "$1").$2
  "$BENCH" step --store "$STORES/$s" --params "$3" --steps "$STEPS" --tensors "$TENSORS" \
    --snapshot "$SNAP" --chunk-size "$CHUNK" --budget "$BUDGET" --backend "$BACKEND" --json \
    >"$OUT/$s.json" 2>"$OUT/$s.err" &
  local p=$!
  echo "$p" >"$OUT/$s.pid"
  wait "$p"
}
run_rank() {
  local r=$1 t0 t1
  t0=$(now)
  if [[ $MODE == seq ]]; then
    run_store "$r" dense "$DENSE" && run_store "$r" expert "$EXPERT"
  else
    run_store "$r" dense "$DENSE" & local p=$!
    local e=0; run_store "$r" expert "$EXPERT" || e=$?
    wait "$p" && [[ $e == 0 ]]
  fi
  local rc=$?
  t1=$(now)
  echo "$t0 $t1" >"$OUT/$(rank_name "$r").wall"
  return $rc
}
# Device memory as the driver sees it (context included), sampled every 0.5 s.
if [[ $BACKEND == cuda || -n ${MULTIRANK_SAMPLE_SMI:-} ]] && command -v nvidia-smi >/dev/null; then
  ( while :; do
      nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null
      sleep 0.5
    done ) >"$OUT/nvidia-smi.csv" &
  SMI_PID=$!
fi
T_STEP0=$(now)
for ((r = 0; r < RANKS; r++)); do run_rank "$r" & RANK_PIDS+=($!); done
FAILED=0
for ((r = 0; r < RANKS; r++)); do
  if ! wait "${RANK_PIDS[$r]}"; then
    FAILED=1; echo "multirank: rank $(rank_name "$r") failed:" >&2
    cat "$OUT/$(rank_name "$r")".*.err >&2 || true
  fi
done
T_STEP1=$(now)
[[ -z $SMI_PID ]] || { kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null || true; SMI_PID=""; }
RANK_PIDS=()
[[ $FAILED == 0 ]] || die "a rank failed (see $OUT/*.err)"
echo "multirank: stepping phase done in $(awk -v a="$T_STEP0" -v b="$T_STEP1" 'BEGIN{printf "%.1f", b-a}') s"

# 2. One mount for the node.
start_mount "$STORES" "$MNT" "$OUT/optstate-mount.log"

# 3. cp -r of every store's snapshot, in parallel.
T_CP0=$(now)
CP_PIDS=()
for src in "$MNT"/*/snapshots/"$SNAP"; do
  s=$(basename "$(dirname "$(dirname "$src")")")
  cp -r "$src" "$CKPT/$s" & CP_PIDS+=($!)
done
[[ ${#CP_PIDS[@]} == $((2 * RANKS)) ]] || die "found ${#CP_PIDS[@]} snapshots '$SNAP' under $MNT, want $((2 * RANKS))"
for p in "${CP_PIDS[@]}"; do wait "$p" || die "cp -r from $MNT failed"; done
T_CP1=$(now)
CKPT_BYTES=$(du -sb "$CKPT" | cut -f1)

# 4. Restore every store into a fresh store, mount the restore root, compare.
T_RS0=$(now)
RS_PIDS=()
for d in "$CKPT"/*; do
  s=$(basename "$d")
  "$RESTORE" "$d" "$REST/$s" --create "$s" -q >"$OUT/restore.$s.log" 2>&1 & RS_PIDS+=($!)
done
for p in "${RS_PIDS[@]}"; do wait "$p" || { cat "$OUT"/restore.*.log >&2; die "optstate-restore failed"; }; done
T_RS1=$(now)
if [[ -n ${MULTIRANK_SELFTEST_CORRUPT:-} ]]; then
  # Self-test of the checks below: flip one byte of one copied tensor file after
  # the restore; the run must then end with MISMATCH and exit 3.
  f=$(find "$CKPT/$(rank_name $((RANKS - 1))).expert/tensors" -type f -name exp_avg | head -1)
  printf '\x5a' | dd of="$f" bs=1 seek=$(( $(stat -c %s "$f") / 2 )) conv=notrunc status=none
  echo "multirank: self-test: flipped the middle byte of $f" >&2
fi
start_mount "$REST" "$MNT2" "$OUT/optstate-mount-restored.log"

# state.safetensors: the header's __metadata__ names the generation and store,
# which the restored store has its own of; compare the header with those masked and
# the data section (every tensor field) byte for byte.
st_hlen() { od -An -t u8 -N8 "$1" | tr -d ' '; }
safetensors_cmp() {
  local a=$1 b=$2 ha hb
  ha=$(st_hlen "$a") hb=$(st_hlen "$b")
  if ! diff <(head -c $((8 + ha)) "$a" | tail -c "$ha" | sed 's/"optstate.generation":"[0-9]*"/"optstate.generation":"G"/; s/"optstate.store_uuid":"[^"]*"/"optstate.store_uuid":"U"/') \
            <(head -c $((8 + hb)) "$b" | tail -c "$hb" | sed 's/"optstate.generation":"[0-9]*"/"optstate.generation":"G"/; s/"optstate.store_uuid":"[^"]*"/"optstate.store_uuid":"U"/') \
            >>"$OUT/verify.log"; then
    echo "$a vs $b: safetensors headers differ beyond the generation" >>"$OUT/verify.log"; return 1
  fi
  if ! cmp <(tail -c +$((9 + ha)) "$a") <(tail -c +$((9 + hb)) "$b") >>"$OUT/verify.log" 2>&1; then
    echo "$a vs $b: safetensors data differ" >>"$OUT/verify.log"; return 1
  fi
  [[ $(stat -c %s "$a") -gt $((8 + ha)) ]] || { echo "$a: no data section" >>"$OUT/verify.log"; return 1; }
}
MISMATCH=0 NFILES=0 NBYTES=0
for d in "$CKPT"/*; do
  s=$(basename "$d")
  [[ -d $MNT2/$s/latest ]] || { echo "MISMATCH: $MNT2/$s/latest missing" >&2; MISMATCH=1; continue; }
  # Same file set on both sides.
  if ! diff <(cd "$d" && find . -type f | sort) <(cd "$MNT2/$s/latest" && find . -type f | sort) \
      >"$OUT/files.$s.diff"; then
    echo "MISMATCH: file sets differ for $s (see $OUT/files.$s.diff)" >&2; MISMATCH=1
  fi
  while IFS= read -r f; do
    NFILES=$((NFILES + 1)); NBYTES=$((NBYTES + $(stat -c %s "$d/$f")))
    if [[ $f == ./manifest.json ]]; then
      # The manifest names the generation the files came from; the restored
      # store has its own. Compare it with the generation-specific keys removed
      # (and the manifest's own checksum, which covers them).
      if ! cmp -s "$d/$f" "$MNT2/$s/latest/$f"; then
        diff "$d/$f" "$MNT2/$s/latest/$f" >"$OUT/manifest.$s.rawdiff" || true
        if ! diff <(grep -v '"generation"\|"uuid"\|"manifest_xxh3"' "$d/$f") \
                  <(grep -v '"generation"\|"uuid"\|"manifest_xxh3"' "$MNT2/$s/latest/$f") \
                  >"$OUT/manifest.$s.diff"; then
          echo "MISMATCH: $s manifest.json (see $OUT/manifest.$s.diff)" >&2; MISMATCH=1
        else
          echo "note: $s manifest.json differs only in generation/uuid/checksum lines ($OUT/manifest.$s.rawdiff)" >>"$OUT/verify.log"
        fi
      fi
    elif [[ $f == ./state.safetensors ]]; then
      safetensors_cmp "$d/$f" "$MNT2/$s/latest/$f" || { echo "MISMATCH: $s $f" >&2; MISMATCH=1; }
    elif ! cmp "$d/$f" "$MNT2/$s/latest/$f" >>"$OUT/verify.log" 2>&1; then
      echo "MISMATCH: $s $f (checkpoint vs restored latest/)" >&2; MISMATCH=1
    fi
  done < <(cd "$d" && find . -type f | sort)
  if ! "$INSPECT" "$REST/$s" verify >"$OUT/inspect-verify.$s.log" 2>&1; then
    echo "MISMATCH: optstate-inspect $REST/$s verify failed" >&2; cat "$OUT/inspect-verify.$s.log" >&2; MISMATCH=1
  fi
done
# Independent reference: the synthetic run is deterministic, so every rank's
# dense (and expert) tensor files are identical to rank0000's.
R0=$(rank_name 0)
for kind in dense expert; do
  for ((r = 1; r < RANKS; r++)); do
    s=$(rank_name "$r").$kind
    if ! diff -r -q "$CKPT/$R0.$kind/tensors" "$CKPT/$s/tensors" >>"$OUT/verify.log" 2>&1; then
      echo "MISMATCH: $s differs from $R0.$kind (deterministic input)" >&2; MISMATCH=1
    fi
  done
done
# Every store stepped to step count STEPS.
for f in "$OUT"/rank*.json; do
  [[ $(jget step_count "$f") == "$STEPS" ]] || { echo "MISMATCH: $f step_count != $STEPS" >&2; MISMATCH=1; }
done
[[ $NFILES -gt 0 ]] || { echo "MISMATCH: no files compared" >&2; MISMATCH=1; }

DISK_MB=$(du -s --block-size=1M "$STORES" "$CKPT" "$REST" | awk '{printf "%s%s %d MiB", sep, $2, $1; sep=", "}')
# 5. fio with one job per rank on the same filesystem, same bytes as stepping moved.
STATE_BYTES=$((12 * PPR * RANKS))
MOVED=$((2 * STATE_BYTES * STEPS))  # each step reads and writes all 12 B/param
FIO_GBS="(skipped: --no-fio)"
if [[ $NO_FIO == 0 ]]; then
  mkdir -p "$FIODIR"
  per_job=$(( (12 * PPR + CHUNK_B - 1) / CHUNK_B * CHUNK_B ))
  fio --name=multirank --directory="$FIODIR" --numjobs="$RANKS" --ioengine=io_uring --direct=1 \
      --bs="$CHUNK_B" --iodepth=32 --rw=randrw --rwmixread=50 --size="$per_job" \
      --io_size=$((2 * per_job * STEPS)) --end_fsync=1 --group_reporting \
      --output-format=json --output="$OUT/fio.json" >"$OUT/fio.log" 2>&1 || die "fio failed (see $OUT/fio.log)"
  rm -rf "$FIODIR"
  FIO_GBS=$(grep -o '"bw_bytes" : [0-9]*' "$OUT/fio.json" | awk '{s += $3} END {printf "%.3f", s / 1e9}')
fi

# Summary.
SUM=$OUT/summary.txt
{
  echo "multirank summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), $(nproc) CPUs)"
  echo "command: $0 --bin $BIN --root $ROOT --ranks $RANKS --params-per-rank $PPR --steps $STEPS" \
       "--budget $BUDGET --backend $BACKEND --chunk-size $CHUNK --tensors $TENSORS --store-mode $MODE"
  echo "ranks $RANKS x {dense $DENSE, expert $EXPERT} params; state $(awk -v b=$STATE_BYTES 'BEGIN{printf "%.2f GB", b/1e9}')" \
       "total; $STEPS steps; snapshot $SNAP; store mode $MODE"
  printf '%-9s %-7s %12s %12s %12s %14s %14s %14s\n' rank backend dense_s/step expert_s/step rank_s/step peak_dense peak_expert peak_rank
  for ((r = 0; r < RANKS; r++)); do
    n=$(rank_name "$r")
    ds=$(jget seconds "$OUT/$n.dense.json") es=$(jget seconds "$OUT/$n.expert.json")
    pd=$(jget peak_resident_bytes "$OUT/$n.dense.json") pe=$(jget peak_resident_bytes "$OUT/$n.expert.json")
    printf '%-9s %-7s %12.3f %12.3f %12.3f %14s %14s %14s\n' "$n" "$(jget backend "$OUT/$n.dense.json")" \
      "$(awk -v a="$ds" -v k="$STEPS" 'BEGIN{print a/k}')" "$(awk -v a="$es" -v k="$STEPS" 'BEGIN{print a/k}')" \
      "$(awk -v a="$ds" -v b="$es" -v k="$STEPS" -v m="$MODE" 'BEGIN{print (m=="seq" ? a+b : (a>b?a:b))/k}')" \
      "$pd" "$pe" "$([[ $MODE == seq ]] && echo $((pd > pe ? pd : pe)) || echo $((pd + pe)))"
  done
  for ((r = 0; r < RANKS; r++)); do
    n=$(rank_name "$r")
    ds=$(jget seconds "$OUT/$n.dense.json") es=$(jget seconds "$OUT/$n.expert.json")
    awk -v a="$ds" -v b="$es" -v k="$STEPS" -v m="$MODE" 'BEGIN{print (m=="seq" ? a+b : (a>b?a:b))/k}'
  done | sort -g | awk -v m="$MOVED" -v k="$STEPS" '{v[NR]=$1} END {printf "rank step time (both stores): min %.3f s, max %.3f s, spread max/min %.2fx; in-step aggregate %.3f GB/s (state moved / (slowest rank step time x steps))\n", v[1], v[NR], v[NR]/v[1], m/1e9/(v[NR]*k)}'
  budget_b=$(jget budget_bytes "$OUT/$R0.dense.json")
  if [[ -s $OUT/nvidia-smi.csv ]]; then
    for ((r = 0; r < RANKS; r++)); do
      n=$(rank_name "$r")
      awk -F', *' -v a="$(cat "$OUT/$n.dense.pid")" -v b="$(cat "$OUT/$n.expert.pid")" -v n="$n" \
        '$1 == a || $1 == b { if ($2 > m) m = $2 } END { printf "%s %s MiB", n, (m ? m : "n/a") }'  "$OUT/nvidia-smi.csv"
      echo
    done | paste -sd';' | sed 's/^/peak device memory per rank from nvidia-smi (context included; max over its processes): /'
  elif [[ $BACKEND == cuda ]]; then
    echo "peak device memory from nvidia-smi: not available (nvidia-smi missing or no samples)"
  fi
  echo "disk use before cleanup: $DISK_MB"
  echo "peak device memory: per store as counted by the memory manager (peak_resident_bytes; excludes" \
       "the CUDA context); peak_rank = max (seq) or sum (par) of the two; budget $budget_b bytes per store"
  awk -v m="$MOVED" -v a="$T_STEP0" -v b="$T_STEP1" 'BEGIN{printf "stepping phase: %.1f s wall (all ranks, incl. process start, registration, gradients on the host); state moved %.2f GB (24 B/param/step); aggregate %.3f GB/s\n", b-a, m/1e9, m/1e9/(b-a)}'
  echo "fio: $RANKS jobs, io_uring, direct=1, bs $CHUNK_B, iodepth 32, randrw 50/50, same bytes, end_fsync: aggregate $FIO_GBS$([[ $NO_FIO == 0 ]] && echo " GB/s")"
  awk -v n="$CKPT_BYTES" -v a="$T_CP0" -v b="$T_CP1" 'BEGIN{printf "cp -r of %d snapshots from the mount: %.2f GB in %.1f s (%.3f GB/s)\n", '$((2 * RANKS))', n/1e9, b-a, n/1e9/(b-a)}'
  awk -v a="$T_RS0" -v b="$T_RS1" 'BEGIN{printf "restore (optstate-restore --create, all stores in parallel): %.1f s\n", b-a}'
  echo "verify: $NFILES files, $NBYTES bytes compared with cmp against the restored stores' latest/ (second mount);" \
       "ranks' tensor files identical to rank0000; optstate-inspect verify on all $((2 * RANKS)) restored stores:" \
       "$([[ $MISMATCH == 0 ]] && echo "ALL MATCH" || echo "MISMATCH (see stderr)")"
} | tee "$SUM"
[[ $MISMATCH == 0 ]] || exit 3
