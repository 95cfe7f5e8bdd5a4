"""A PEP 517 backend that builds the pure-Python optstate wheel with the
standard library only, so that `pip install ./python` needs no network."""
import base64
import hashlib
import os
import zipfile

NAME, VERSION = "optstate", "0.1.0"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIST = "%s-%s.dist-info" % (NAME, VERSION)
_TAG = "py3-none-any"


def _metadata():
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: Optimizer state on NVMe, "
            "streamed through a bounded GPU window\nRequires-Python: >=3.9\n" % (NAME, VERSION))


def _files(editable):
    if editable:  # a .pth pointing at the source tree
        yield "%s.pth" % NAME, (_ROOT + "\n").encode()
        return
    pkg = os.path.join(_ROOT, NAME)
    for base, _, names in sorted(os.walk(pkg)):
        for n in sorted(names):
            if n.endswith(".py") or n.startswith("liboptstate.so"):
                path = os.path.join(base, n)
                with open(path, "rb") as f:
                    yield os.path.relpath(path, _ROOT), f.read()


def _wheel(wheel_directory, editable):
    wheel_name = "%s-%s-%s.whl" % (NAME, VERSION, _TAG)
    records = []
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel_name), "w", zipfile.ZIP_DEFLATED) as z:
        def add(arcname, data):
            z.writestr(arcname, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            records.append("%s,sha256=%s,%d" % (arcname, digest, len(data)))
        for arcname, data in _files(editable):
            add(arcname, data)
        add(_DIST + "/METADATA", _metadata().encode())
        add(_DIST + "/WHEEL", ("Wheel-Version: 1.0\nGenerator: optstate_build\nRoot-Is-Purelib: true\n"
                               "Tag: %s\n" % _TAG).encode())
        records.append(_DIST + "/RECORD,,")
        z.writestr(_DIST + "/RECORD", "\n".join(records) + "\n")
    return wheel_name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, editable=False)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, editable=True)
