#!/usr/bin/env bash
# Session 16: does the state.safetensors fill take on this machine? Per daemon option set: a cold
# cp -r of the trainer snapshot (daemon's chunk count), and after reading tensors/ only, how much of
# state.safetensors is in the page cache (fincore). Usage: fill_probe.sh CARRY OUT
set -uo pipefail
C=$(cd "$1" && pwd); OUTD=$2; W=${W:-/root/osb}
export PATH=$C/bin:$PATH LD_LIBRARY_PATH=$C/lib OPTSTATE_LOG_LEVEL=info OPTSTATE_NO_PROGRESS=1
mkdir -p "$W" "$OUTD"
optstate-bench mount --dir "$W" --hidden 1024 --state 1G --rounds 1 --keep > "$OUTD/probe_bench.log" 2>&1
R=$W/bench-mount; M=$R/mnt; S=$M/bench/snapshots/bench
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
# Pages of a file in the page cache, "N of M" (mincore of a mapping; no fincore on Ubuntu's image).
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
mnt() { optstate-mount -f $1 "$R/root" "$M" > "$OUTD/probe_mount.log" 2>&1 &
  for _ in $(seq 100); do mountpoint -q "$M" && break; sleep 0.1; done; }
umnt() { fusermount3 -u "$M"; wait; grep -o '[0-9]* chunks loaded' "$OUTD/probe_mount.log"; }
for opt in "" --no-fill-safetensors "" --no-fill-safetensors; do
  mnt "$opt"; drop; s=$(date +%s.%N); cp -r "$S" /dev/shm/probe; e=$(date +%s.%N); rm -rf /dev/shm/probe
  a=$(umnt); mnt "$opt"; drop; ls "$S" > /dev/null; find "$S/tensors" -type f -exec cat {} + > /dev/null; sleep 0.5
  fc=$(resident "$S/state.safetensors"); b=$(umnt)
  echo "opt='$opt' cp $(awk "BEGIN{print $e-$s}") s, $a; tensors/ only: $b, state.safetensors resident after: $fc"
done
uname -r
