#!/usr/bin/env bash
# Installs the Debian packages optstate needs that are missing. Idempotent and
# quiet on a second run (prints nothing when everything is present).
set -euo pipefail
PKGS=(build-essential g++ cmake ninja-build pkg-config git
      librocksdb-dev liburing-dev libfuse3-dev fuse3
      libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libxxhash-dev
      nlohmann-json3-dev libcli11-dev fio clang libclang-rt-dev
      python3 python3-torch python3-numpy e2fsprogs util-linux systemd rsync)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "optstate setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
