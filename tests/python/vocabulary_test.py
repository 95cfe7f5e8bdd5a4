"""The Python package's copies of the C ABI's vocabulary are the header's.

optstate/c.h's codes and dtypes are checked against base/status.h and
base/dtype.h when the library is built (capi/internal/c_util.cc); this test
checks the package's copies (errors.py's codes, core.py's dtype and access
constants, _lib.py's ABI version and StepArgs struct) against c.h as written,
and the codes' names against the loaded library's optstate_code_name."""
import ctypes
import os
import re
import unittest

from common import optstate
from optstate import _lib, core, errors

_HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "capi", "include", "optstate", "c.h")


def _header():
    with open(_HEADER) as f:
        text = f.read()
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)  # comments may mention names in passing


def _enum(text, name):
    """{NAME: value} of `typedef enum name { ... } name;`."""
    m = re.search(r"typedef enum %s \{(.*?)\} %s;" % (name, name), text, flags=re.S)
    assert m, "no enum %s in %s" % (name, _HEADER)
    return {k: int(v) for k, v in re.findall(r"(OPTSTATE_\w+)\s*=\s*(\d+)", m.group(1))}


def _camel(c_name):
    """OPTSTATE_INVALID_ARGUMENT -> InvalidArgument."""
    return "".join(w.capitalize() for w in c_name[len("OPTSTATE_"):].split("_"))


class VocabularyTest(unittest.TestCase):
    def setUp(self):
        self.h = _header()

    def test_error_codes(self):
        codes = _enum(self.h, "optstate_code")
        self.assertEqual(codes.pop("OPTSTATE_OK"), 0)
        classes = {cls.code: cls for cls in errors.Error.__subclasses__()}
        for c_name, value in codes.items():
            cls = classes.get(value)
            self.assertIsNotNone(cls, "%s = %d has no optstate.Error subclass" % (c_name, value))
            self.assertEqual(cls.__name__, _camel(c_name), c_name)
            self.assertIs(errors.from_code(value, "m").__class__, cls)
            self.assertEqual(optstate._lib_handle.optstate_code_name(value).decode(), cls.__name__, c_name)
        self.assertEqual(set(classes), set(codes.values()), "errors.py has codes c.h does not")

    def test_dtypes_and_access(self):
        dtypes = _enum(self.h, "optstate_dtype")
        for c_name, value in dtypes.items():
            self.assertEqual(getattr(core, c_name[len("OPTSTATE_"):]), value, c_name)
        access = _enum(self.h, "optstate_access")
        for c_name, value in access.items():
            self.assertEqual(getattr(core, c_name[len("OPTSTATE_ACCESS_"):]), value, c_name)
        m = re.search(r"#define OPTSTATE_HOST_CACHE_AUTO (\w+)", self.h)
        self.assertEqual(m.group(1), "UINT64_MAX")
        self.assertEqual(core.HOST_CACHE_AUTO, (1 << 64) - 1)

    def test_abi_version_and_step_args(self):
        m = re.search(r"#define OPTSTATE_C_ABI_VERSION (\d+)", self.h)
        self.assertEqual(_lib.ABI_VERSION, int(m.group(1)))
        self.assertEqual(optstate._lib_handle.optstate_abi_version(), _lib.ABI_VERSION)
        m = re.search(r"#define OPTSTATE_EXPORT_NO_SAFETENSORS (\d+)u", self.h)
        self.assertEqual(_lib.EXPORT_NO_SAFETENSORS, int(m.group(1)))
        m = re.search(r"#define OPTSTATE_RESHARD_NO_SAFETENSORS (\d+)u", self.h)
        self.assertEqual(_lib.RESHARD_NO_SAFETENSORS, int(m.group(1)))
        for c_name, py in (("optstate_adam_step_args_t", _lib.StepArgs),
                           ("optstate_adam_register_args_t", _lib.RegisterArgs),
                           ("optstate_checkpoint_export_args_t", _lib.ExportArgs),
                           ("optstate_checkpoint_reshard_args_t", _lib.ReshardArgs)):
            m = re.search(r"typedef struct %s \{(.*?)\} %s;" % (c_name, c_name), self.h, flags=re.S)
            fields = re.findall(r"(\w+);", m.group(1))
            self.assertEqual([f for f, _ in py._fields_], fields, c_name)
            self.assertEqual(ctypes.sizeof(py), 8 * len(fields), c_name)  # size_t and pointers, no padding


if __name__ == "__main__":
    unittest.main()
