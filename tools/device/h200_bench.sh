#!/usr/bin/env bash
# The benchmark run on the H200 machine (the requirement), in parts that each fit one
# device call (10 minutes). Binaries packed into CARRY by tools/device/pack.sh
# (optstate-bench, optstate-mount, memmgr_gpu_test, a static fio, fusermount3; BIN=DIR puts
# DIR's binaries first, e.g. BIN=CARRY/old for a by-hand part with the earlier build);
# CARRY/old/optstate-bench, if present, is an earlier build for an A/B of the
# step in the same call. Logs and a summary go to OUT.
#   bash tools/device/h200_bench.sh CARRY OUT step   # io engine; step: ours, old, ours (floor + first version each)
#   bash tools/device/h200_bench.sh CARRY OUT rest   # host-cache step, sleep, mount (one tensor, trainer mix x2), gpu tests
#   bash tools/device/h200_bench.sh CARRY OUT views  # where a cold cp -r of the trainer snapshot waits; a hidden-4096 mix
#   bash tools/device/h200_bench.sh CARRY OUT fill   # cp -r with the state.safetensors fill on and off
#   bash tools/device/h200_bench.sh CARRY OUT probe  # chunks loaded per copy and state.safetensors' residency, fill on / off
#   bash tools/device/h200_bench.sh CARRY OUT prefetch  # cp -r with the Prefetcher at 32 MiB, 256 MiB and 1 GiB ahead
#   bash tools/device/h200_bench.sh CARRY OUT profile  # strace and perf of a warm and a cold cp -r (perf, strace packed)
#   bash tools/device/h200_bench.sh CARRY OUT waits  # strace -tt -T of cold and warm cp -r (strace packed; waits_summary.py), CPU
#   bash tools/device/h200_bench.sh CARRY OUT blksize  # cp -r with st_blksize 1, 2 and 4 MiB
#   bash tools/device/h200_bench.sh CARRY OUT ab     # cp -r of the trainer snapshot: this build vs CARRY/old, interleaved
#   bash tools/device/h200_bench.sh CARRY OUT folios # warm read of state.safetensors the push filled vs the kernel's read-ahead
#   bash tools/device/h200_bench.sh CARRY OUT fresh  # does memory the VM gave back cost cp? tmpfs cp, cold cp -r 3 ways
#   bash tools/device/h200_bench.sh CARRY OUT load   # warm cp -r and tmpfs cp with 0-8 other processes copying memory
#   bash tools/device/h200_bench.sh CARRY OUT pagecache  # cp -r with --page-cache all, mappable, small
#   bash tools/device/h200_bench.sh CARRY OUT loop   # training-loop simulation, tier holds the state; old build's step A/B
#   bash tools/device/h200_bench.sh CARRY OUT loop2  # training-loop simulation, tier of half the state and none
#   bash tools/device/h200_bench.sh CARRY OUT fast   # the step on tmpfs (/dev/shm, O_DIRECT), with and without
#                                                    # hash threads: a stand-in for NVMe faster than this ~2 GB/s disk
set -uo pipefail
C=$(cd "$1" && pwd); OUTD=$2; PART=${3:-step}; W=${W:-/root/osb}
export PATH=${BIN:-$C/bin}:$C/bin:$PATH LD_LIBRARY_PATH=$C/lib OPTSTATE_LOG_LEVEL=warn OPTSTATE_NO_PROGRESS=1
mkdir -p "$W" "$OUTD"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; uname -r; nproc; df -h "$W" | tail -1
  cat /sys/block/*/queue/max_sectors_kb 2>/dev/null | head -1; date -u; } > "$OUTD/env-$PART.txt" 2>&1
run() { local name=$1 t=$2; shift 2; echo "== $name: $*" | tee -a "$OUTD/summary.txt"
  timeout "$t" "$@" > "$OUTD/$name.log" 2>&1; echo "rc=$?" >> "$OUTD/$name.log"
  tail -n 14 "$OUTD/$name.log" >> "$OUTD/summary.txt"; rm -rf "${W:?}"/*; }
STEP=(step --dir "$W" --state 8G --budget 2G --backend cuda --rounds 3)
MIX=(mount --dir "$W" --hidden 1024 --state 1G --rounds 3)  # the trainer's snapshot, 2 GiB in 263 files
# For the by-hand parts (views, probe): the trainer's snapshot kept under $W (sets R, M, S), the
# page cache dropped, a command's seconds, optstate-mount on $M (LOG, then its options), and how
# much of a file is in the page cache ("N of M pages": mincore; no fincore on Ubuntu's image).
keep_store() { optstate-bench mount --dir "$W" --hidden 1024 --state 1G --rounds 1 --keep > "$OUTD/$1" 2>&1
  R=$W/bench-mount; M=$R/mnt; S=$M/bench/snapshots/bench; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
secs() { local s e; s=$(date +%s.%N); "$@" > /dev/null 2>&1; e=$(date +%s.%N); awk "BEGIN{printf \"%.3f\", $e-$s}"; }
mnt() { local log=$1; shift; OPTSTATE_LOG_LEVEL=info optstate-mount -f "$@" "$R/root" "$M" > "$log" 2>&1 &
  for _ in $(seq 100); do mountpoint -q "$M" && break; sleep 0.1; done; }
# fio's reference for the kept snapshot: fio_ref sets B (its bytes) and lays $R/fio.dat of that
# size once; fiot prints the seconds of one sequential read of it (1 MiB, QD 32, O_DIRECT).
fio_ref() { B=$(python3 -c "import os,sys; print(sum(os.path.getsize(os.path.join(d,f)) for d,_,fs in os.walk(sys.argv[1]) for f in fs))" "$S")
  fio --name=lay --filename="$R/fio.dat" --rw=write --bs=1M --size=$((B/4096*4096)) --direct=1 > /dev/null 2>&1; }
fiot() { fio --name=r --filename="$R/fio.dat" --rw=read --bs=1M --iodepth=32 --ioengine=io_uring --direct=1 \
    --size=$((B/4096*4096)) --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["read"]["runtime"]/1000)'; }
resident() { python3 - "$1" <<'PY'
import ctypes, mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY); size = os.fstat(fd).st_size
m = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
pages = (size + 4095) // 4096; vec = (ctypes.c_ubyte * pages)()
ctypes.CDLL("libc.so.6").mincore(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(m))),
                                  ctypes.c_size_t(size), vec)
print(f"{sum(v & 1 for v in vec)} of {pages} pages")
PY
}
case $PART in
  step)
    run io 150 optstate-bench io --dir "$W" --size 2G --chunk-sizes 8M --rounds 3
    run step_new1 150 optstate-bench "${STEP[@]}"
    [ -x "$C/old/optstate-bench" ] && run step_old 150 "$C/old/optstate-bench" "${STEP[@]}"
    run step_new2 150 optstate-bench "${STEP[@]}"
    ;;
  fast)
    # The step on a RAM-backed directory (tmpfs takes O_DIRECT since Linux 6.6), a stand-in for
    # NVMe faster than the pipeline: every method is at this machine's disk floor (~2 GB/s), and
    # there the first version's sync I/O is as fast as anything. With and without hash threads.
    M=/dev/shm/optstate-fast; mkdir -p "$M"; df -h /dev/shm | tail -1 >> "$OUTD/env-$PART.txt"
    W=$M run step_fast 170 optstate-bench step --dir "$M" --state 4G --budget 2G --backend cuda --rounds 3
    W=$M run step_fast_nohash 170 optstate-bench step --dir "$M" --state 4G --budget 2G --backend cuda \
        --rounds 3 --hash-threads 0
    rm -rf "$M"
    ;;
  views)
    # Which part of a cold `cp -r` of the trainer's snapshot waits (run of 2026-12-02): per round, fio's
    # read of the same bytes; the copy cold; with only tensors/ already in the page cache; with
    # only state.safetensors in it; warm; and each view copied alone, cold.
    keep_store views_bench.log; D=/dev/shm/views-copy
    mnt "$OUTD/views_mount.log"
    fio_ref
    warm_tensors() { find "$S/tensors" -type f -exec cat {} + > /dev/null; }
    echo "bytes $B" | tee -a "$OUTD/summary.txt"
    for r in 1 2 3 4; do
      drop; f=$(fiot)
      drop; c=$(secs cp -r "$S" "$D"); rm -rf "$D"
      drop; warm_tensors; a=$(secs cp -r "$S" "$D"); rm -rf "$D"
      drop; cat "$S/state.safetensors" > /dev/null; b=$(secs cp -r "$S" "$D"); rm -rf "$D"
      w=$(secs cp -r "$S" "$D"); rm -rf "$D"
      drop; st=$(secs cp "$S/state.safetensors" /dev/shm/views-st); rm -f /dev/shm/views-st
      drop; tt=$(secs cp -r "$S/tensors" "$D"); rm -rf "$D"
      echo "round $r: fio $f cold $c tensors-warm $a state-warm $b warm $w | alone cold: state $st tensors $tt" | tee -a "$OUTD/summary.txt"
    done
    fusermount3 -u "$M"; wait; rm -rf "${W:?}"/*
    run mount_mix4096 200 optstate-bench mount --dir "$W" --hidden 4096 --state 4G --rounds 3
    ;;
  fill)
    # The state.safetensors fill (run of 2026-12-02), interleaved A/B: on (the default) and off.
    for i in 1 2; do
      run fill_on_$i 100 optstate-bench "${MIX[@]}" --fill-safetensors
      run fill_off_$i 100 optstate-bench "${MIX[@]}" --no-fill-safetensors
    done
    run fill_on_4096 150 optstate-bench mount --dir "$W" --hidden 4096 --state 2G --rounds 3 --fill-safetensors
    run fill_off_4096 150 optstate-bench mount --dir "$W" --hidden 4096 --state 2G --rounds 3 --no-fill-safetensors
    ;;
  probe)
    # Does the state.safetensors fill take on this machine (run of 2026-12-02)? Per option set: a cold
    # cp -r of the snapshot (chunks the daemon loaded), and after reading tensors/ only, how much
    # of state.safetensors is in the page cache.
    keep_store probe_bench.log; L=$OUTD/probe_mount.log
    loaded() { fusermount3 -u "$M"; wait; grep -o '[0-9]* chunks loaded' "$L"; }
    for opt in --fill-safetensors --no-fill-safetensors --fill-safetensors --no-fill-safetensors; do
      mnt "$L" "$opt"; drop; c=$(secs cp -r "$S" /dev/shm/probe); rm -rf /dev/shm/probe; a=$(loaded)
      mnt "$L" "$opt"; drop; ls "$S" > /dev/null; find "$S/tensors" -type f -exec cat {} + > /dev/null; sleep 0.5
      fc=$(resident "$S/state.safetensors"); b=$(loaded)
      echo "$opt: cp $c s, $a; tensors/ only: $b, state.safetensors resident after: $fc" | tee -a "$OUTD/summary.txt"
    done
    rm -rf "${W:?}"/*
    ;;
  prefetch)
    # Files opened ahead of cp (run of 2026-12-02): with the fill the disk is 40-45% busy during a copy;
    # does a deeper Prefetcher use that headroom? Interleaved: the default (32 files, 32 MiB),
    # 64 files / 256 MiB, 64 files / 1 GiB (64 files: the most optstate-mount takes).
    for i in 1 2; do
      run pf_default_$i 100 optstate-bench "${MIX[@]}"
      run pf_256_$i 100 optstate-bench "${MIX[@]}" --prefetch-files 64 --prefetch-mib 256
      run pf_1024_$i 100 optstate-bench "${MIX[@]}" --prefetch-files 64 --prefetch-mib 1024
    done
    run pf_default_4096 150 optstate-bench mount --dir "$W" --hidden 4096 --state 2G --rounds 3
    run pf_1024_4096 150 optstate-bench mount --dir "$W" --hidden 4096 --state 2G --rounds 3 \
        --prefetch-files 64 --prefetch-mib 1024
    ;;
  profile)
    # Where a copy of the trainer's snapshot spends its time (run of 2026-12-02): strace's per-call
    # summary of cp and perf's system-wide profile (cp, the daemon, the kernel), warm and cold.
    # Needs perf and strace packed into CARRY (pack.sh /usr/bin/perf /usr/bin/strace).
    keep_store profile_bench.log; D=/dev/shm/profile-copy
    mnt "$OUTD/profile_mount.log"; cp -r "$S" "$D"; rm -rf "$D"
    for kind in warm cold warm2 cold2; do
      case $kind in cold*) drop ;; esac
      strace -c -w -f -o "$OUTD/strace_$kind.txt" cp -r "$S" "$D"; rm -rf "$D"
      case $kind in cold*) drop ;; esac
      perf record -a -g -e cpu-clock -o "$W/perf.data" -- cp -r "$S" "$D" > /dev/null 2>&1; rm -rf "$D"
      perf report -i "$W/perf.data" --stdio --no-children --sort comm,sym --percent-limit 0.5 -g none \
          > "$OUTD/perf_$kind.txt" 2>&1
      perf report -i "$W/perf.data" --stdio --no-children --sort comm --percent-limit 0.5 -g none \
          > "$OUTD/perf_comm_$kind.txt" 2>&1
    done
    fusermount3 -u "$M"; wait
    # The device tool brings back only a few files: one archive.
    (cd "$OUTD" && tar czf profile.tgz strace_* perf_* profile_mount.log && rm -f strace_* perf_*)
    rm -rf "${W:?}"/*
    ;;
  waits)
    # Where a cold copy waits (run of 2026-12-02): every openat/read/write/close of cp with its time
    # (strace -tt -T), cold twice and warm once, summed per kind of call by
    # tools/device/waits_summary.py off the machine; and the CPU of every core over an untraced
    # cold and warm copy (/proc/stat's first line: the daemon's reader and pusher threads are
    # short-lived, so its own per-thread counts miss them).
    keep_store waits_bench.log; D=/dev/shm/waits-copy
    mnt "$OUTD/waits_mount.log"; cp -r "$S" "$D"; rm -rf "$D"
    for kind in cold1 warm cold2; do
      case $kind in cold*) drop ;; esac
      strace -f -tt -T -e trace=openat,read,write,close -o "$OUTD/st_$kind.txt" cp -r "$S" "$D"; rm -rf "$D"
    done
    for kind in cold warm; do
      case $kind in cold*) drop ;; esac
      head -1 /proc/stat > "$OUTD/stat_${kind}_0.txt"
      echo "$kind untraced: $(secs cp -r "$S" "$D") s" | tee -a "$OUTD/summary.txt"; rm -rf "$D"
      head -1 /proc/stat > "$OUTD/stat_${kind}_1.txt"
    done
    fusermount3 -u "$M"; wait
    (cd "$OUTD" && tar czf waits.tgz st_* stat_* waits_mount.log && rm -f st_* stat_*)
    rm -rf "${W:?}"/*
    ;;
  blksize)
    # st_blksize, the buffer cp copies with (run of 2026-12-02, asked because a warm copy spent ~10% of
    # cp's time in shmem_write_end: no difference between the sizes; that tmpfs has no large folios).
    for i in 1 2; do
      for kib in 1024 2048 4096; do run bs${kib}_$i 100 optstate-bench "${MIX[@]}" --blksize-kib $kib; done
    done
    ;;
  ab)
    # This build's mount against an earlier one (CARRY/old: optstate-bench and optstate-mount side
    # by side, so the bench finds that mount) and a variant (CARRY/alt, the same), interleaved, two
    # rounds per call.
    for i in 1 2; do
      run ab_new_$i 100 optstate-bench "${MIX[@]}"
      [ -x "$C/old/optstate-bench" ] && run ab_old_$i 100 "$C/old/optstate-bench" "${MIX[@]}"
      [ -x "$C/alt/optstate-bench" ] && run ab_alt_$i 100 "$C/alt/optstate-bench" "${MIX[@]}"
    done
    ;;
  folios)
    # Does a page cache the kernel's read-ahead filled read faster than one the push filled
    # (run of 2026-12-02: pushed pages are order-0 folios; read-ahead may allocate large ones)? The
    # trainer snapshot's state.safetensors (1 GiB), filled each way, then read warm three times;
    # a tmpfs copy of it (this tmpfs: order-0 only) is the reference.
    keep_store folios_bench.log
    mnt "$OUTD/folios_mount1.log"; F=$S/state.safetensors
    warm() { for i in 1 2 3; do echo -n " $(secs dd if="$1" of=/dev/null bs=1M)"; done; }
    drop; echo "push fill: $(secs cat "$F") s; warm:$(warm "$F")" | tee -a "$OUTD/summary.txt"
    cp "$F" /dev/shm/folios-ref; echo "tmpfs copy warm:$(warm /dev/shm/folios-ref)" | tee -a "$OUTD/summary.txt"
    rm -f /dev/shm/folios-ref; fusermount3 -u "$M"; wait
    mnt "$OUTD/folios_mount2.log" --kernel-readahead-mib 16; drop
    # A READ at a nonzero offset first: that open never pushes, so the kernel's read-ahead fills.
    t=$(secs python3 -c "import os,sys; fd=os.open(sys.argv[1],os.O_RDONLY); n=os.fstat(fd).st_size
os.pread(fd,4096,n-4096)
while os.read(fd,1<<20): pass" "$F")
    echo "read-ahead fill: $t s; warm:$(warm "$F")" | tee -a "$OUTD/summary.txt"
    ls -l "$F" >> "$OUTD/summary.txt"; fusermount3 -u "$M"; wait
    rm -rf "${W:?}"/*
    ;;
  fresh)
    # Does memory the guest has not touched lately cost a copy (run of 2026-12-02)? These machines are
    # Firecracker VMs booted with free page reporting (page_reporting.page_reporting_order=11 on
    # both kernel command lines): memory freed for a few seconds goes back to the host, and
    # touching it again faults it in. fio allocates nothing; cp -r allocates its tmpfs copy and,
    # from the mount, the mount's page cache. First a 2 GiB tmpfs-to-tmpfs cp: into memory idle
    # for 20 s, right after freeing a copy, and 20 s later. Then per round: fio; the trainer
    # snapshot's cold cp -r into memory idle 20 s ("stale"), right after dropping the caches
    # ("bench": optstate-bench's own order), and right after touching and freeing 5 GiB ("recent").
    cat /proc/cmdline >> "$OUTD/env-$PART.txt"; free -g >> "$OUTD/env-$PART.txt"
    A=/dev/shm/fresh-a; head -c 2G /dev/urandom > $A
    sleep 20; x=$(secs cp $A $A.b); rm -f $A.b; y=$(secs cp $A $A.b); rm -f $A.b
    sleep 20; z=$(secs cp $A $A.b); rm -f $A.b $A
    echo "tmpfs 2 GiB cp: idle 20 s $x, right after a free $y, idle 20 s $z" | tee -a "$OUTD/summary.txt"
    keep_store fresh_bench.log; D=/dev/shm/fresh-copy
    mnt "$OUTD/fresh_mount.log"
    fio_ref
    touch5() { head -c 5G /dev/zero > /dev/shm/fresh-touch; rm -f /dev/shm/fresh-touch; }
    for r in 1 2 3 4; do
      drop; f=$(fiot)
      drop; sleep 20; s=$(secs cp -r "$S" "$D"); rm -rf "$D"
      drop; b=$(secs cp -r "$S" "$D"); rm -rf "$D"
      drop; touch5; n=$(secs cp -r "$S" "$D"); rm -rf "$D"
      echo "round $r: fio $f cold cp: stale $s bench $b recent $n" | tee -a "$OUTD/summary.txt"
    done
    fusermount3 -u "$M"; wait; rm -rf "${W:?}"/*
    ;;
  load)
    # Is a cold copy's extra time the daemon's CPU beside cp (run of 2026-12-02)? A warm copy of the
    # trainer snapshot (nothing for the daemon to do) and a tmpfs-to-tmpfs copy of it, alone and
    # with N other processes copying memory meanwhile (cat of a 512 MiB tmpfs file in a loop:
    # page-cache copies, as the daemon's pushes and fills are); a cold copy per round for scale.
    # ROUNDS (default 3) and LOADN (default "0 2 4 8") shorten it, e.g. on the 2-core dev VM.
    keep_store load_bench.log; D=/dev/shm/load-copy; L=/dev/shm/load-src
    mnt "$OUTD/load_mount.log"; head -c 512M /dev/zero > $L
    cp -r "$S" /dev/shm/load-ref
    for r in $(seq "${ROUNDS:-3}"); do
      drop; c=$(secs cp -r "$S" "$D"); rm -rf "$D"; line="round $r: cold $c"
      for n in ${LOADN:-0 2 4 8}; do
        pids=(); for _ in $(seq $n); do (while :; do cat $L > /dev/null; done) & pids+=($!); done
        sleep 0.2; w=$(secs cp -r "$S" "$D"); rm -rf "$D"; t=$(secs cp -r /dev/shm/load-ref "$D"); rm -rf "$D"
        # The loops first (so that no new cat starts), then the cat each was in: killing a loop
        # orphans its cat. (A bare `wait` would wait for the daemon too.)
        [ $n -gt 0 ] && { kill "${pids[@]}" 2> /dev/null; wait "${pids[@]}" 2> /dev/null; pkill -x -f "cat $L"; }
        line="$line | $n busy: warm $w tmpfs $t"
      done
      echo "$line" | tee -a "$OUTD/summary.txt"
    done
    rm -rf /dev/shm/load-ref $L; fusermount3 -u "$M"; wait; rm -rf "${W:?}"/*
    ;;
  pagecache)
    # Which files go through the page cache (run of 2026-12-02), interleaved: all (the default); mappable
    # (field files straight to the daemon, state.safetensors cached and filled from their bytes);
    # small (only files of at most 128 KiB cached).
    for i in 1 2; do
      run pc_all_$i 100 optstate-bench "${MIX[@]}"
      run pc_mappable_$i 100 optstate-bench "${MIX[@]}" --page-cache mappable
      run pc_small_$i 100 optstate-bench "${MIX[@]}" --page-cache small
    done
    ;;
  loop|loop2)
    # --prefetch T: T s of simulated forward/backward, then Step with the previous commit (and its
    # write tail) in flight; exposed step without and with Prefetch() in each round.
    L=(step --dir "$W" --state 8G --budget 2G --backend cuda --no-fio --prefetch 10)
    if [ "$PART" = loop ]; then
      run loop_tier 450 optstate-bench "${L[@]}" --rounds 3 --host-cache-bytes 10G --first-version warm
      # The write tail's A/B: Step() returned vs its commit done, this build vs CARRY/old.
      [ -x "$C/old/optstate-bench" ] && run loop_tier_old 120 "$C/old/optstate-bench" step --dir "$W" \
          --state 8G --budget 2G --backend cuda --no-fio --rounds 3 --host-cache-bytes 10G --first-version none
    else
      run loop_half 280 optstate-bench "${L[@]}" --rounds 2 --host-cache-bytes 4G --first-version cold
      run loop_none 280 optstate-bench "${L[@]}" --rounds 2 --host-cache-bytes 0 --first-version none
    fi
    ;;
  rest)
    run step_cache 100 optstate-bench step --dir "$W" --state 6G --hidden 4096 --budget 2G --backend cuda \
        --host-cache-bytes 8G --durable-every 100 --rounds 5 --no-fio --no-first-version
    run sleep 60 optstate-bench sleep --dir "$W" --budget 2G --backend cuda --rounds 5
    run mount 130 optstate-bench mount --dir "$W" --state 3G --rounds 3
    run mount_mix_new1 70 optstate-bench "${MIX[@]}"
    run mount_mix_new2 70 optstate-bench "${MIX[@]}"
    [ -x "$C/bin/memmgr_gpu_test" ] && run gpu_test 150 memmgr_gpu_test
    ;;
esac
