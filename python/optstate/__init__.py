"""optstate: optimizer state on NVMe, streamed through a bounded device window.

optstate.torch.AdamW is the torch.optim.Optimizer; Store, MemoryManager and
StreamedAdam are the handles of the C ABI (liboptstate.so) it is built on.
This package is pure Python (ctypes) and never compiled against torch."""
from . import checkpoint, errors
from ._lib import lib as _lib_handle
from ._lib import set_log_level
from .core import (BF16, F16, F32, NONE, Q8S, Q8U, READ, READ_WRITE, WRITE, MemoryManager, PinnedRange, Store,
                   StreamedAdam)
from .errors import (AlreadyExists, Busy, Cancelled, Corruption, DataLoss, Error, FailedPrecondition,
                     Internal, InvalidArgument, IoError, NoSpace, NotFound, ResourceExhausted, Unimplemented)

reshard = checkpoint.reshard

__version__ = "0.1.0"


def library_version():
    """The version of the loaded liboptstate.so."""
    return _lib_handle.optstate_version().decode()


def library_path():
    """Where liboptstate.so was loaded from."""
    return _lib_handle.path
