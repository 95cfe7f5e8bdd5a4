#!/usr/bin/env bash
# Packs binaries for the GPU machine (Ubuntu 24.04, which lacks librocksdb,
# liburing, libfuse3, spdlog, ...): strips copies of the given executables into
# DEST/bin and copies the non-glibc shared libraries they need into DEST/lib.
# Usage: tools/device/pack.sh DEST BINARY...   then there: LD_LIBRARY_PATH=DEST/lib DEST/bin/x
set -euo pipefail
dest=$1; shift
mkdir -p "$dest/bin" "$dest/lib"
for b in "$@"; do
  cp "$b" "$dest/bin/" && strip "$dest/bin/$(basename "$b")"
  { ldd "$b" 2>/dev/null || true; } | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libgcc_s.so*|libstdc++.so*) ;;
      *) [ -e "$dest/lib/$(basename "$lib")" ] || { cp -L "$lib" "$dest/lib/"; strip "$dest/lib/$(basename "$lib")" 2>/dev/null || true; } ;;
    esac
  done
done
du -sh "$dest"
