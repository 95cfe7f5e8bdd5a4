"""Shared by the Python tests: makes the source tree's package importable and
gives each test a fresh directory and small, fast store settings."""
import json
import os
import shutil
import sys
import tempfile
import time
import unittest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if os.path.join(_REPO, "python") not in sys.path:
    sys.path.insert(0, os.path.join(_REPO, "python"))

import optstate  # noqa: E402

# 2 MiB chunks, a small pipeline: every store in these tests is a few MiB.
STORE_KW = dict(chunk_size_bytes=2 << 20)
OPT_KW = dict(backend="host", budget=64 << 20, chunk_size_bytes=2 << 20, read_ahead_chunks=2)


class TempDirTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="optstate-py-")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)


def binary(env, *rel):
    """A tool of the build: $env if set, else build/default/<rel>; None when not built."""
    path = os.environ.get(env) or os.path.join(_REPO, "build", "default", *rel)
    return path if os.access(path, os.X_OK) else None


def mounted(mnt):
    """Whether mnt is a mount point now (the kernel's mount table)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == mnt for line in f)


# How long a wait on something no event signals (a mount appearing, another
# process's state) may take before a test calls it a hang: generous, so that
# only a hang fails, never a slow or loaded machine.
HANG_LIMIT_S = 60


def wait_for(done, limit_s=HANG_LIMIT_S, poll_s=0.02):
    """Polls done() until it returns true or limit_s has passed; its last value."""
    deadline = time.monotonic() + limit_s
    while True:
        if done():
            return True
        if time.monotonic() >= deadline:
            return bool(done())
        time.sleep(poll_s)


def safetensors_of(ckpt):
    """(whether the optstate checkpoint directory ckpt holds state.safetensors, its manifest's
    "state_safetensors" value or None where the key is absent): (False, False) for a checkpoint written
    without it, (True, None) for one with it."""
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    return os.path.exists(os.path.join(ckpt, "state.safetensors")), manifest.get("state_safetensors")
