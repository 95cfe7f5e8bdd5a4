#!/usr/bin/env python3
# Where the disk idles while a tree is read from the mount (docs/BENCHMARKS.md,
# 2026-12-02). Drops the page cache (unless NODROP=1), then either reads every
# file under SRC in tree order with read(2) of st_blksize (as optstate-bench
# mount's read pass does) or runs `cp -r SRC DEST` (DEST removed after), while
# a thread samples /sys/block/DEV/inflight every 0.5 ms. Prints the time, the
# mean depth, and how long nothing was in flight, by the file being read: the
# split by file that optstate-bench mount's "disk busy" column does not give.
#   python3 tools/device/disk_timeline.py /mnt/optstate/s/snapshots/x vda [DEST]
# Root only (drop_caches). By hand, on the benchmark machines; not a test.
import os, shutil, subprocess, sys, threading, time
src, dev = sys.argv[1], sys.argv[2]
cp_dest = sys.argv[3] if len(sys.argv) > 3 else None
samples = []; stop = False
def sampler():
    p = f"/sys/block/{dev}/inflight"
    while not stop:
        with open(p) as f: r, w = f.read().split()
        samples.append((time.perf_counter(), int(r)))
        time.sleep(0.0005)
files = []
for root, dirs, names in os.walk(src):
    dirs.sort()
    for n in sorted(names):
        files.append(os.path.join(root, n))
if not os.environ.get("NODROP"): os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
t = threading.Thread(target=sampler); t.start()
time.sleep(0.05)
log = []  # (path, start, end, bytes) per file read; one entry for a whole cp -r
t0 = time.perf_counter()
if cp_dest:
    subprocess.run(["cp", "-r", src, cp_dest], check=True)
    n = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(cp_dest) for f in fs)
    log = [(src, t0, time.perf_counter(), n)]
else:
    for p in files:
        a = time.perf_counter()
        fd = os.open(p, os.O_RDONLY); n = 0
        bs = os.fstat(fd).st_blksize
        while True:
            b = os.read(fd, bs)
            if not b: break
            n += len(b)
        os.close(fd)
        log.append((p, a, time.perf_counter(), n))
t1 = log[-1][2]
time.sleep(0.05); stop = True; t.join()
tot = sum(x[3] for x in log)
print(f"{'cp -r' if cp_dest else 'read'} {tot/2**30:.2f} GiB in {t1-t0:.3f} s = {tot/(t1-t0)/1e9:.2f} GB/s, {len(files)} files")
# idle (0 in flight) time, by the file being read
idle = {}; depth_sum = 0.0; tt = 0.0
j = 0
for (ta, ra), (tb, _) in zip(samples, samples[1:]):
    if ta < t0 or ta > t1: continue
    dt = tb - ta; tt += dt; depth_sum += ra * dt
    while j < len(log) - 1 and log[j][2] < ta: j += 1
    key = "state.safetensors" if "state.safetensors" in log[j][0] else ("tensors" if "/tensors/" in log[j][0] else os.path.basename(log[j][0]))
    if ra == 0: idle[key] = idle.get(key, 0) + dt
for p, a, b, n in log:
    if n > 100 << 20: print(f"  {os.path.relpath(p, src)}: {b-a:.3f} s, {n/(b-a)/1e9:.2f} GB/s")
tens = [x for x in log if "/tensors/" in x[0]]
if tens:
    tb = sum(x[3] for x in tens); ts = tens[-1][2] - tens[0][1]
    print(f"  tensors/: {tb/2**30:.2f} GiB in {ts:.3f} s = {tb/ts/1e9:.2f} GB/s")
if cp_dest: shutil.rmtree(cp_dest)
print(f"mean depth {depth_sum/tt:.1f}; idle (0 in flight) by what was being read: " + ", ".join(f"{k} {v*1000:.0f} ms" for k, v in idle.items()))
