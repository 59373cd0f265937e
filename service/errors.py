"""The one error hierarchy of hoist.

Every error hoist raises on purpose derives from :class:`HoistError`; anything else
escaping is a bug. ``service.api.errors`` maps each class to an HTTP status in one place.

::

    HoistError
    ├── FormatError                  the bytes are not a valid GGUF file
    │   ├── NotGGUFError             too small, or the magic is not "GGUF"
    │   ├── UnsupportedVersionError  version 1, or newer than hoist knows
    │   ├── TruncatedError           the file ends inside a header structure
    │   ├── MetadataError            a KV pair is invalid (duplicate key, type, alignment)
    │   ├── TensorInfoError          a tensor info is invalid (name, n_dims, ne, type, offset)
    │   ├── TensorBoundsError        a tensor's data lies outside its file
    │   ├── HeaderTooLargeError      the header is larger than a service allows
    │   └── InvalidDataError         tensor data holds NaN/Inf values or scales (check-tensors)
    ├── SplitError                   split files that do not form one model
    ├── ByteOrderError               big-endian tensor data on a little-endian host
    ├── StorageError                 the OS refused a file operation (open, read, mmap)
    ├── NotFoundError                no such job or loaded model
    │   ├── ModelPathError           a requested model file does not exist
    │   └── GoneError                what was asked for is no longer kept
    ├── RequestError                 a request names an unknown option, or a path that
    │   │                            leaves the models directory
    │   ├── WorkLimitError           the request needs more work than one request may take
    │   └── RequestAbandonedError    the client went away; the work was stopped
    ├── BusyError                    too many requests or loads wait already; retry later
    ├── AuthError                    no valid bearer token
    ├── ConflictError                the request does not fit the resource's state
    ├── PlacementError               no valid placement (flags, buffer types, devices)
    │   └── BudgetExceededError      the plan does not fit the devices' free memory
    ├── DeviceError                  a device refused an operation
    │   └── OutOfMemoryError         an allocation failed
    └── LoadCancelledError           a load was cancelled before it finished
"""

from __future__ import annotations

from typing import Any, ClassVar

_MAX_MESSAGE = 2000
_MAX_FIELD = 512


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (with the length cut off noted)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class HoistError(Exception):
    """Base class: a clear message naming the file, and the key, tensor or offset involved.

    Attributes:
        message: what went wrong, without the location prefix.
        path: the file involved, if any.
        offset: byte offset in ``path`` where the problem was found, if it helps.
        key: the GGUF KV key involved, if any.
        tensor: the tensor name involved, if any.
        hint: what the user can do about it, if anything.
    """

    code: ClassVar[str] = "hoist_error"

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        key: str | None = None,
        tensor: str | None = None,
        hint: str | None = None,
    ) -> None:
        # names and values from a file can be long: messages stay readable and bounded
        self.message = clip(message, _MAX_MESSAGE)
        self.path = path if path is None else clip(path, _MAX_FIELD)
        self.offset = offset
        self.key = key if key is None else clip(key, _MAX_FIELD)
        self.tensor = tensor if tensor is None else clip(tensor, _MAX_FIELD)
        self.hint = hint
        super().__init__(self.describe())

    def describe(self) -> str:
        """The full one-line message: ``PATH: MESSAGE (at byte N); HINT``."""
        text = f"{self.path}: {self.message}" if self.path else self.message
        if self.offset is not None:
            text += f" (at byte {self.offset})"
        if self.hint:
            text += f"; {self.hint}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """The error as JSON-ready data (``code``, ``message`` and the location fields)."""
        data: dict[str, Any] = {"code": self.code, "message": self.describe()}
        for name in ("path", "offset", "key", "tensor", "hint"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        return data


class FormatError(HoistError):
    """The file is not a valid GGUF file."""

    code = "invalid_gguf"


class NotGGUFError(FormatError):
    """The file is too small to be GGUF, or does not start with the magic ``GGUF``."""

    code = "not_gguf"


class UnsupportedVersionError(FormatError):
    """The GGUF version is 1 (no longer supported) or newer than hoist knows."""

    code = "unsupported_gguf_version"


class TruncatedError(FormatError):
    """The file ends inside the header, a KV pair or a tensor info."""

    code = "truncated_gguf"


class MetadataError(FormatError):
    """A KV pair is invalid: duplicate or empty key, unknown value type, nested array,
    a length over the limits, or ``general.alignment`` of the wrong type or value."""

    code = "invalid_gguf_metadata"


class TensorInfoError(FormatError):
    """A tensor info is invalid: name, n_dims, ne, ggml type or data offset."""

    code = "invalid_tensor_info"


class TensorBoundsError(FormatError):
    """A tensor's data ``[offset, offset + nbytes)`` does not lie inside its file."""

    code = "tensor_out_of_bounds"


class HeaderTooLargeError(FormatError):
    """The header (metadata and tensor infos) is larger than the limit a service sets on
    the memory one file's header may take."""

    code = "header_too_large"


class InvalidDataError(FormatError):
    """Tensor data failed the row-data validation of check-tensors (NaN or Inf values or
    block scales); the message lists every bad tensor.

    Attributes:
        tensors: tensor name -> what was found first in it.
    """

    code = "invalid_tensor_data"

    def __init__(self, message: str, *, tensors: dict[str, str], **kwargs: Any) -> None:
        self.tensors = tensors
        super().__init__(message, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["tensors"] = dict(self.tensors)
        return data


class SplitError(HoistError):
    """Split files that do not form one model: wrong first split, missing sibling,
    tensor count mismatch, or a tensor in two splits."""

    code = "invalid_split"


class ByteOrderError(HoistError):
    """Tensor data in a byte order this host cannot use as it is."""

    code = "unsupported_byte_order"


class StorageError(HoistError):
    """The operating system refused a file operation (open, stat, read, mmap)."""

    code = "storage_error"


class NotFoundError(HoistError):
    """No job or loaded model has the requested id."""

    code = "not_found"


class ModelPathError(NotFoundError):
    """A requested model file does not exist."""

    code = "model_not_found"


class GoneError(NotFoundError):
    """What was asked for existed but is no longer kept (the plan of an ended job)."""

    code = "gone"


class RequestError(HoistError):
    """A request names an unknown option, an invalid value, or a path outside the
    models directory."""

    code = "invalid_request"


class WorkLimitError(RequestError):
    """A request needs more work (time, matches, items) than one request may take."""

    code = "work_limit_exceeded"


class RequestAbandonedError(RequestError):
    """The client went away (or a deadline passed) and the request's work was stopped."""

    code = "request_abandoned"


class CallbackRefusedError(RequestError):
    """A load's callback URL is not one the service may call (``HOIST_CALLBACK_HOSTS``,
    scheme, credentials, length)."""

    code = "callback_refused"


class BusyError(HoistError):
    """Too many loads or requests are waiting already; try again later.

    Attributes:
        retry_after: seconds after which a retry may succeed.
    """

    code = "busy"

    def __init__(self, message: str, *, retry_after: int = 5, **kwargs: Any) -> None:
        self.retry_after = retry_after
        super().__init__(message, **kwargs)


class AuthError(HoistError):
    """The request carries no valid bearer token."""

    code = "unauthorized"


class ConflictError(HoistError):
    """The request does not fit the state of what it targets (cancelling a finished job)."""

    code = "conflict"


class ModelLimitError(ConflictError):
    """As many models are resident or on their way (queued or loading) as the service
    holds; one must be unloaded first."""

    code = "model_limit"


class PlacementError(HoistError):
    """No valid placement: bad placement flags, an unknown buffer type, a device
    without split buffers, a tensor larger than a device's largest allocation."""

    code = "invalid_placement"


class BudgetExceededError(PlacementError):
    """The plan needs more memory on some device than it has free; the message gives
    the per-device breakdown."""

    code = "insufficient_device_memory"


class DeviceError(HoistError):
    """A device refused an operation."""

    code = "device_error"


class OutOfMemoryError(DeviceError):
    """An allocation on a device failed."""

    code = "out_of_memory"


class LoadCancelledError(HoistError):
    """The load was cancelled; everything it had taken has been released."""

    code = "load_cancelled"
