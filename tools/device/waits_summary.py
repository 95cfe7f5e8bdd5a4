#!/usr/bin/env python3
"""Sums an `strace -f -tt -T` log of `cp -r` from the mount (h200_bench.sh waits)
per kind of call: openat, close, writes, and reads of the mount's files split
into the first read of a file (offset 0), later reads, and the read at EOF,
with state.safetensors apart. Lists the reads that took more than 1 ms.
Usage: waits_summary.py ST_LOG...
"""
import collections
import re
import sys

CALL = re.compile(r'(\d+)\s+(\d+):(\d+):([\d.]+) (\w+)\((.*)\) += (-?\d+).*<([\d.]+)>')

for path in sys.argv[1:]:
    fds, pos = {}, {}
    total, count = collections.Counter(), collections.Counter()
    slow = []
    first = last = None
    for line in open(path):
        m = CALL.match(line)
        if not m:
            continue
        _, h, mi, s, call, args, ret, dur = m.groups()
        ret, dur = int(ret), float(dur)
        at = int(h) * 3600 + int(mi) * 60 + float(s)
        first = at if first is None else first
        last = at + dur
        if call == 'openat':
            name = re.search(r'"([^"]*)"', args).group(1)
            if ret >= 0:
                fds[ret], pos[ret] = name, 0
            kind = 'openat'
        elif call not in ('read', 'write'):
            kind = call
        else:
            fd = int(args.split(',')[0])
            name = fds.get(fd, '?')
            kind = call
            if call == 'read' and '/mnt/' in name:
                off = pos.get(fd, 0)
                pos[fd] = off + max(ret, 0)
                kind = 'read at 0' if off == 0 else ('read at EOF' if ret == 0 else 'later read')
                if 'state.safetensors' in name:
                    kind += ', state.safetensors'
                if dur > 0.001:
                    slow.append((dur, name.split('snapshots/')[-1], off))
        total[kind] += dur
        count[kind] += 1
    print(f'{path}: span {last - first:.3f} s')
    for kind in sorted(total):
        print(f'  {kind:36s} {count[kind]:6d} calls {total[kind]:.3f} s')
    slow.sort(reverse=True)
    print(f'  reads over 1 ms: {len(slow)}, {sum(d for d, _, _ in slow):.3f} s')
    for dur, name, off in slow[:10]:
        print(f'    {dur * 1e3:.1f} ms  {name} at {off}')
