#!/usr/bin/env bash
# Installs what optstate needs that is missing: Debian's packages (the build,
# and Debian's python3-torch 1.13, the oldest torch supported), then a virtual
# environment at <repo>/.venv with a current torch (CPU), transformers,
# accelerate and lightning from PyPI (tools/requirements-current.txt), where
# the Python tests run a second time. Idempotent and quiet on a second run
# (prints nothing when everything is present). OPTSTATE_NO_VENV=1 skips the
# virtual environment (about 4 GB: PyPI's torch brings its CUDA libraries);
# the tests on current torch then fail, saying so.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PKGS=(build-essential g++ cmake ninja-build pkg-config git
      librocksdb-dev liburing-dev libfuse3-dev fuse3
      libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libxxhash-dev
      nlohmann-json3-dev libcli11-dev fio clang libclang-rt-dev
      python3 python3-venv python3-torch python3-numpy e2fsprogs util-linux systemd rsync)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -ne 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "optstate setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ "${OPTSTATE_NO_VENV:-0}" = 1 ] && exit 0
# The environment is remade when the requirements change; the copy of them
# inside it says which it holds, written last (an interrupted install is redone).
VENV="$REPO/.venv"
REQ="$REPO/tools/requirements-current.txt"
if ! cmp -s "$REQ" "$VENV/optstate-requirements.txt" 2>/dev/null; then
  echo "optstate setup: making $VENV (torch, transformers, accelerate, lightning from PyPI)"
  rm -rf "$VENV"
  /usr/bin/python3 -m venv "$VENV"
  # uv downloads the wheels in parallel: ~1 minute where pip alone took ~10 (2 cores, 4 GB).
  "$VENV/bin/pip" install -q --disable-pip-version-check uv==0.13.9
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -r "$REQ"
  cp "$REQ" "$VENV/optstate-requirements.txt"
fi
