"""The exception hierarchy: every failure of optstate is an optstate.Error.

Each subclass matches one code of the C ABI (optstate_code in <optstate/c.h>,
optstate::StatusCode in C++). The message is the library's own and names the
thing (store path, tensor, field, chunk, generation, errno text)."""

__all__ = [
    "Error", "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition", "Busy",
    "ResourceExhausted", "NoSpace", "IoError", "Corruption", "DataLoss", "Cancelled",
    "Unimplemented", "Internal", "from_code",
]


class Error(Exception):
    """Base of every optstate failure. `code` is the C ABI's code, `message` the text."""

    code = -1

    def __init__(self, message):
        super().__init__(message)
        self.message = message


class InvalidArgument(Error, ValueError):
    """Bad input from the caller (names, sizes, dtypes, devices, layouts)."""
    code = 1


class NotFound(Error, LookupError):
    """A store, tensor, field, snapshot or generation that does not exist."""
    code = 2


class AlreadyExists(Error):
    code = 3


class FailedPrecondition(Error):
    """Wrong state: a closed store, pins outstanding, a state_dict of another generation."""
    code = 4


class Busy(Error):
    """The store is open elsewhere (another process or optimizer); the message names the holder."""
    code = 5


class ResourceExhausted(Error):
    """Device budget, pinned memory (RLIMIT_MEMLOCK), file descriptors."""
    code = 6


class NoSpace(Error):
    code = 7


class IoError(Error):
    code = 8


class Corruption(Error):
    """A checksum mismatch or a damaged store."""
    code = 9


class DataLoss(Error):
    """Acknowledged data is gone (a failed fsync poisons the store until reopened)."""
    code = 10


class Cancelled(Error):
    code = 11


class Unimplemented(Error, NotImplementedError):
    code = 12


class Internal(Error):
    """A bug in optstate."""
    code = 13


_BY_CODE = {cls.code: cls for cls in (
    InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Busy, ResourceExhausted,
    NoSpace, IoError, Corruption, DataLoss, Cancelled, Unimplemented, Internal)}


def from_code(code, message):
    """The exception for a C ABI code; the library's "CodeName: " prefix is dropped."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return Internal("unknown optstate code %d: %s" % (code, message))
    prefix = cls.__name__ + ": "
    if message.startswith(prefix):
        message = message[len(prefix):]
    return cls(message)
