"""Read a GGUF file's header, KV metadata and tensor infos (``gguf_init_from_file`` with
``no_alloc``): nothing of the tensor data is read.

Every count and length read from the file is checked against the bytes that remain
before it is used, and every rule of llama.cpp's ``gguf.cpp`` is enforced, so a corrupt or
hostile file gives one :class:`~service.errors.FormatError` naming the file, the key or
tensor and the byte offset, never a crash, a huge allocation or a read past the end.

Layout (all integers in the file's byte order)::

    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x       (string key | u32 value type | value)
    n_tensors x  (string name | u32 n_dims | n_dims x i64 ne | i32 ggml type | u64 offset)
    padding to general.alignment | tensor data

A string is a u64 byte length followed by that many UTF-8 bytes; an array value is a u32
element type, a u64 count and the elements.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from service.cancel import CancelToken, check
from service.errors import (
    FormatError,
    HeaderTooLargeError,
    MetadataError,
    NotGGUFError,
    StorageError,
    TensorInfoError,
    TruncatedError,
    UnsupportedVersionError,
)
from service.io.file import check_inside, open_readonly
from service.loader.ggml_types import GGML_TYPE_COUNT, GGML_TYPES, REMOVED_GGML_TYPES, GGMLType
from service.loader.gguf import batch
from service.loader.gguf.constants import (
    DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    HEADER_NBYTES,
    INT64_MAX,
    KEY_ALIGNMENT,
    MAX_ARRAY_ELEMENTS,
    MAX_DIMS,
    MAX_NAME_BYTES,
    MAX_STRING_BYTES,
    MIN_KV_NBYTES,
    MIN_TENSOR_INFO_NBYTES,
    SCALAR_FORMATS,
    SUPPORTED_VERSIONS,
    GGUFValueType,
)
from service.loader.gguf.limits import HeaderLimits as HeaderLimits  # re-exported
from service.loader.gguf.limits import file_identity as file_identity
from service.loader.gguf.strings import chain_in_block, usual_chain
from service.loader.gguf.values import GGUFArray, GGUFFloat, GGUFString

KVValue = bool | int | GGUFFloat | GGUFString | GGUFArray


@dataclass(frozen=True, slots=True)
class KVEntry:
    """One KV metadata pair.

    Attributes:
        key: the key (``general.architecture``, ...).
        type: the value type (``ARRAY`` for arrays; see ``value.element_type``).
        value: ``bool`` or ``int`` for integer types, :class:`GGUFFloat` (a ``float``
            with its exact bits) for FLOAT32 / FLOAT64, :class:`GGUFString` (a ``str``
            with its exact bytes) for STRING, or a :class:`GGUFArray`.
        offset: byte offset of the pair in the file.
    """

    key: str
    type: GGUFValueType
    value: KVValue
    offset: int

    @property
    def type_name(self) -> str:
        """The value type's GGUF name, ``ARRAY[<element type>]`` for arrays."""
        if isinstance(self.value, GGUFArray):
            return self.value.type_name
        return self.type.name


class TensorInfo(NamedTuple):
    """One tensor info of a GGUF file (a named tuple: immutable, and several times
    cheaper to build than a frozen dataclass; a file has up to hundreds of thousands).

    Attributes:
        name: the tensor name (at most 63 bytes of UTF-8, no NUL; may be empty).
        ne: the ``n_dims`` dimensions the file declares, in ggml order: ``ne[0]`` is the
            row length (fastest-varying), so the numpy shape of the data is ``ne``
            reversed. ``()`` for a scalar (``n_dims`` 0); ggml counts every dimension not
            declared as 1.
        ggml_type: the ggml type of the elements.
        offset: byte offset of the data from the start of the file's data section.
        nbytes: size of the data in bytes (``ggml_nbytes``).
        info_offset: byte offset of this tensor info in the file.
    """

    name: str
    ne: tuple[int, ...]
    ggml_type: GGMLType
    offset: int
    nbytes: int
    info_offset: int

    @property
    def ggml_ne(self) -> tuple[int, int, int, int]:
        """The four dimensions ggml gives the tensor: ``ne`` padded with 1s."""
        ne = (*self.ne, 1, 1, 1, 1)
        return (ne[0], ne[1], ne[2], ne[3])

    @property
    def n_elements(self) -> int:
        """Number of elements (product of ``ne``; 1 for a scalar)."""
        n = 1
        for d in self.ne:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """What a GGUF file declares, parsed without reading tensor data.

    Attributes:
        path: the file.
        file_size: size of the file in bytes.
        version: GGUF version (2 or 3).
        byte_order: ``"little"`` or ``"big"``.
        kv: KV metadata by key, in file order.
        tensors: tensor infos in file order.
        alignment: ``general.alignment`` or the default 32, in bytes.
        data_offset: absolute byte offset of the data section (the aligned end of the
            tensor infos).
        identity: (device, inode, size, mtime in ns) of the file when it was parsed, to
            tell when it was replaced or changed since.
        nbytes_read: bytes read from the file to parse its header (at least
            ``data_offset`` less the padding; reads come in chunks).
    """

    path: str
    file_size: int
    version: int
    byte_order: str
    kv: dict[str, KVEntry]
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    identity: tuple[int, int, int, int] = (0, 0, 0, 0)
    nbytes_read: int = 0
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False, compare=False)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key`` (a scalar, ``str`` or :class:`GGUFArray`), or ``default``."""
        entry = self.kv.get(key)
        return default if entry is None else entry.value

    def tensor(self, name: str) -> TensorInfo:
        """The tensor info named ``name``. Raises ``KeyError`` if there is none."""
        return self._by_name[name]


def read_gguf(
    path: str | os.PathLike[str],
    *,
    cancel: CancelToken | None = None,
    root: str | None = None,
    limits: HeaderLimits | None = None,
) -> GGUFFile:
    """Parse the header, KV metadata and tensor infos of the GGUF file at ``path``.

    Ports ``gguf_init_from_file`` (llama.cpp ``ggml/src/gguf.cpp``) with ``no_alloc``:
    the same rules, with hoist's typed errors. Tensor data is not read and its bounds
    against the file size are checked by the weights index, as llama.cpp's loader does.

    Args:
        path: the file to read.
        cancel: checked every few thousand KV pairs, tensor infos and array strings, so
            that a huge header can be abandoned.
        root: when given, the file as opened must lie inside this directory.
        limits: when given, bounds on the header's size and counts, so that the memory
            and time a header can take are bounded (a service sets them; llama.cpp has
            none beyond ``gguf.cpp``'s).

    Returns:
        The parsed :class:`GGUFFile`.

    Raises:
        StorageError: the file cannot be opened, is not a regular file, or cannot be read.
        FormatError: (a subclass of) the file is not valid GGUF; the message names the
            file, the key or tensor, and the byte offset.
        RequestAbandonedError, WorkLimitError: from ``cancel``.
        RequestError: the file lies outside ``root``.
        HeaderTooLargeError: the header is over one of ``limits``.
    """
    name = os.fspath(path)
    fd = open_readonly(name)
    try:
        if root is not None:
            check_inside(fd, root, name)
        st = os.fstat(fd)
        size = st.st_size
        if size < HEADER_NBYTES:
            try:
                head = os.pread(fd, 32, 0)
            except OSError as exc:
                raise StorageError(f"read failed: {exc.strerror}", path=name, offset=0) from exc
            _check_magic(head, name)
            raise NotGGUFError(
                f"file too small to be GGUF: {size} bytes, a GGUF header has {HEADER_NBYTES}",
                path=name,
            )
        parsed = _Parser(fd, size, name, cancel, limits or HeaderLimits()).parse()
        return replace(parsed, identity=file_identity(st))
    finally:
        os.close(fd)


_LFS_PREFIX = b"version https://git-lfs"

_CHECK_EVERY_MASK = 4095
"""The cancel token is checked every 4096 KV pairs or tensor infos ..."""

_BATCH = True
"""Whether ordinary tensor infos and string-array elements are read by the tight loops of
:mod:`.batch` before the careful walk takes over (the tests turn it off to compare)."""

_CHECK_STRINGS_MASK = (1 << 16) - 1
"""... and every 65536 strings of an array walked one at a time (and once per block of
an array scanned vectorised)."""

_VECTOR_MIN_STRINGS = 4096
"""String arrays with at least this many elements that remain are scanned in blocks with
numpy (:mod:`.strings`); shorter ones, and the tail of long ones, are walked one string
at a time."""

_IMPORT_WORTH_STRINGS = 1 << 20
"""While numpy is not imported yet, string arrays shorter than this are walked one string
at a time all the way: walking a million strings costs about what importing numpy does
(a fifth of a second), so a command that reads one header (``hoist inspect`` of a model
with a 262,144-token vocabulary) finishes sooner without it, and so does the service's
first header read (it starts without numpy); a process that has numpy already (after a
load) always scans."""


def _scan_worth(count: int) -> bool:
    """Whether a string array of ``count`` elements is scanned with numpy (see
    :data:`_IMPORT_WORTH_STRINGS`)."""
    return count >= _IMPORT_WORTH_STRINGS or "numpy" in sys.modules


_SCAN_BLOCK_BYTES = 1 << 20
"""Bytes of one block of a vectorised string-array scan, at most."""


def _align_up(n: int, alignment: int) -> int:
    """``n`` rounded up to a multiple of ``alignment`` (> 0)."""
    return -(-n // alignment) * alignment


def _check_magic(head: bytes, path: str) -> None:
    """Raise :class:`NotGGUFError`, with a hint where the content is recognisable,
    unless ``head`` starts with the GGUF magic."""
    if head[:4] == GGUF_MAGIC:
        return
    if not head:
        raise NotGGUFError("file too small to be GGUF: the file is empty", path=path)
    hint = None
    if head.startswith(_LFS_PREFIX):
        hint = "this looks like a Git LFS pointer, not the model: fetch the real file with `git lfs pull`"
    elif head[:4] in (b"lmgg", b"fmgg", b"tjgg", b"algg"):
        hint = "this is a legacy GGML/GGJT file: convert it to GGUF with llama.cpp's converters"
    elif head.lstrip()[:1] == b"<":
        hint = "this looks like an HTML or XML page, perhaps a failed download"
    shown = "".join(chr(b) if 32 <= b < 127 else "?" for b in head[:4])
    raise NotGGUFError(f"not a GGUF file: magic is '{shown}', expected 'GGUF'", path=path, offset=0, hint=hint)


_FIRST_READ = 64 << 10
"""Bytes of the first read of a header; later reads double what was read (so a header
costs at most twice its size in reads, plus this)."""


class _Parser:
    """A bounded cursor over the head of a file.

    The bytes are read with ``pread`` into a buffer that grows (doubling, never past the
    file's size) as the cursor advances: the header is never mapped, so a file that
    shrinks while it is parsed gives an error rather than SIGBUS, and memory stays within
    twice the header's size.
    """

    def __init__(
        self, fd: int, size: int, path: str, cancel: CancelToken | None = None, limits: HeaderLimits | None = None
    ) -> None:
        self.cancel = cancel
        self.limits = limits or HeaderLimits()
        self.limit = self.limits.max_bytes
        self.fd = fd
        self.size = size
        self.path = path
        self.data = bytearray()
        self.pos = 0
        self.endian = "<"
        self._structs: dict[str, struct.Struct] = {}

    # -- primitives ---------------------------------------------------------------------

    def _fill(self, end: int) -> None:
        """Make ``self.data`` hold at least bytes ``[0, end)`` (``end`` <= size).

        Raises:
            HeaderTooLargeError: ``end`` is past the header limit.
        """
        have = len(self.data)
        if end <= have:
            return
        if self.limit is not None and end > self.limit:
            raise HeaderTooLargeError(
                f"the header is larger than the limit of {self.limit} bytes (reading byte {end})",
                path=self.path,
                offset=have,
            )
        want = min(self.size, max(end, 2 * have, _FIRST_READ))
        if self.limit is not None:
            want = min(want, self.limit)
        data = self.data
        while have < want:
            # read straight into the grown buffer, then drop what the read did not fill
            data += bytes(want - have)
            try:
                with memoryview(data) as view:
                    n = os.preadv(self.fd, [view[have:want]], have)
            except OSError as exc:
                del data[have:]
                raise StorageError(f"read failed: {exc.strerror}", path=self.path, offset=have) from exc
            del data[have + n :]
            if not n:
                if have >= end:
                    return
                raise TruncatedError(
                    f"the file ended at byte {have} while being read; it was {self.size} bytes (did it shrink?)",
                    path=self.path,
                    offset=have,
                )
            have += n

    def _need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise TruncatedError(
                f"unexpected end of file inside {what}: {n} bytes needed, {self.size - self.pos} remain"
                f" (file is {self.size} bytes)",
                path=self.path,
                offset=self.pos,
            )
        self._fill(self.pos + n)

    def _scalar(self, fmt: str, nbytes: int, what: str) -> Any:
        self._need(nbytes, what)
        code = self.endian + fmt
        st = self._structs.get(code)
        if st is None:
            st = self._structs[code] = struct.Struct(code)
        (value,) = st.unpack_from(self.data, self.pos)
        self.pos += nbytes
        return value

    def u32(self, what: str) -> int:
        return int(self._scalar("I", 4, what))

    def i32(self, what: str) -> int:
        return int(self._scalar("i", 4, what))

    def u64(self, what: str) -> int:
        return int(self._scalar("Q", 8, what))

    def i64(self, what: str) -> int:
        return int(self._scalar("q", 8, what))

    def raw_string(self, what: str, *, key: str | None = None, limit: int = MAX_STRING_BYTES) -> bytes:
        """A length-prefixed string's bytes; the length is checked against the bytes that
        remain and against ``limit`` before anything is read."""
        start = self.pos
        length = self.u64(f"the length of {what}")
        remain = self.size - self.pos
        if length > remain:
            raise TruncatedError(
                f"the length of {what} is {length} bytes, which exceeds the {remain} bytes that remain",
                path=self.path,
                offset=start,
                key=key,
            )
        if length > limit:
            error = TensorInfoError if limit < MAX_STRING_BYTES else MetadataError
            raise error(
                f"{what} is {length} bytes long, at most {limit} are allowed",
                path=self.path,
                offset=start,
                key=key,
            )
        self._fill(self.pos + length)
        data = bytes(self.data[self.pos : self.pos + length])
        self.pos += length
        return data

    def _view(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of what was read, not copied: the buffer cannot grow
        while the view (or anything made from it) is alive, so it is only passed to a
        call that keeps nothing of it."""
        return memoryview(self.data)[start:end]

    def _copy(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of what was read (``end`` <= bytes read), copied once."""
        with memoryview(self.data) as view:
            return view[start:end].tobytes()

    # -- structure ----------------------------------------------------------------------

    def parse(self) -> GGUFFile:
        self._fill(min(32, self.size))
        _check_magic(bytes(self.data[:32]), self.path)
        self.pos = 4
        version = self.u32("the version")
        if version == 0:
            raise UnsupportedVersionError("bad GGUF version 0", path=self.path, offset=4)
        if version & 0xFFFF == 0:
            # the version reads as 0x0N000000: the file was written big-endian
            self.endian = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
            try:
                return self._parse_body(version)
            except FormatError as exc:
                raise type(exc)(
                    "the version field is byte-swapped (a big-endian file), but the file is not "
                    f"valid big-endian GGUF either: {exc.message}",
                    path=exc.path,
                    offset=exc.offset,
                    key=exc.key,
                    tensor=exc.tensor,
                    hint=exc.hint,
                ) from exc
        return self._parse_body(version)

    def _parse_body(self, version: int) -> GGUFFile:
        if version == 1:
            raise UnsupportedVersionError(
                "GGUF version 1 is no longer supported",
                path=self.path,
                offset=4,
                hint="convert the model again with a current llama.cpp",
            )
        if version not in SUPPORTED_VERSIONS:
            raise UnsupportedVersionError(
                f"unknown GGUF version {version}: hoist reads versions {', '.join(map(str, SUPPORTED_VERSIONS))}",
                path=self.path,
                offset=4,
            )
        n_tensors = self.u64("the tensor count")
        n_kv = self.u64("the KV count")
        # A count that could not fit even in the whole file is corrupt: say so at once.
        # Otherwise parsing runs into the end of the file by itself (each item consumes
        # bytes, so the loops are bounded by the file size) and names where it stopped.
        for count, min_nbytes, what, at in (
            (n_kv, MIN_KV_NBYTES, "KV pairs", 16),
            (n_tensors, MIN_TENSOR_INFO_NBYTES, "tensor infos", 8),
        ):
            if HEADER_NBYTES + count * min_nbytes > self.size:
                raise TruncatedError(
                    f"the header declares {count} {what}, which cannot fit in a file of {self.size} bytes"
                    " (truncated or corrupt)",
                    path=self.path,
                    offset=at,
                )

        for count, limit, what, at in (
            (n_kv, self.limits.max_kv, "KV pairs", 16),
            (n_tensors, self.limits.max_tensors, "tensor infos", 8),
        ):
            if limit is not None and count > limit:
                raise HeaderTooLargeError(
                    f"the header declares {count} {what}, more than the limit of {limit}", path=self.path, offset=at
                )

        kv: dict[str, KVEntry] = {}
        for i in range(n_kv):
            if not i & _CHECK_EVERY_MASK:
                check(self.cancel)
            entry = self._kv_pair(i, kv)
            kv[entry.key] = entry

        alignment = DEFAULT_ALIGNMENT
        align_entry = kv.get(KEY_ALIGNMENT)
        if align_entry is not None:
            if align_entry.type != GGUFValueType.UINT32:
                raise MetadataError(
                    f"'{KEY_ALIGNMENT}' has type {align_entry.type_name}, expected UINT32",
                    path=self.path,
                    key=KEY_ALIGNMENT,
                    offset=align_entry.offset,
                )
            alignment = int(align_entry.value)  # type: ignore[arg-type]
            if alignment == 0 or alignment & (alignment - 1):
                raise MetadataError(
                    f"'{KEY_ALIGNMENT}' is {alignment}, it must be a non-zero power of two",
                    path=self.path,
                    key=KEY_ALIGNMENT,
                    offset=align_entry.offset,
                )

        tensors: list[TensorInfo] = []
        by_name: dict[str, TensorInfo] = {}
        i = 0
        while i < n_tensors:
            if not i & _CHECK_EVERY_MASK:
                check(self.cancel)
            if _BATCH:
                # ordinary tensor infos up to the next cancel check, in one loop
                stop = min(n_tensors, (i | _CHECK_EVERY_MASK) + 1)
                i, self.pos = batch.tensor_infos(
                    self.data, self.pos, i, stop, by_name, self.endian, TensorInfo, tensors
                )
                if i == stop:
                    continue
            info = self._tensor_info(i, by_name)
            tensors.append(info)
            by_name[info.name] = info
            i += 1

        data_offset = self.pos
        if tensors:
            data_offset = _align_up(self.pos, alignment)
            if data_offset > self.size:
                raise TruncatedError(
                    f"the data section would start at byte {data_offset}, past the end of the file ({self.size} bytes)",
                    path=self.path,
                    offset=self.pos,
                )
        self._check_layout(tensors, alignment)
        return GGUFFile(
            path=self.path,
            file_size=self.size,
            version=version,
            byte_order="little" if self.endian == "<" else "big",
            kv=kv,
            tensors=tensors,
            alignment=alignment,
            data_offset=data_offset,
            nbytes_read=len(self.data),
            _by_name=by_name,
        )

    def _kv_pair(self, index: int, seen: dict[str, KVEntry]) -> KVEntry:
        start = self.pos
        raw_key = self.raw_string(f"the key of KV pair {index}")
        try:
            key = raw_key.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MetadataError(
                f"the key of KV pair {index} is not valid UTF-8 ({raw_key[:64]!r})",
                path=self.path,
                offset=start,
            ) from exc
        if not key:
            raise MetadataError(f"the key of KV pair {index} is empty", path=self.path, offset=start)
        if "\0" in key:
            raise MetadataError(
                f"the key of KV pair {index} contains a NUL byte ({raw_key[:64]!r})",
                path=self.path,
                offset=start,
                hint="names are compared up to their first NUL in llama.cpp, so such a key could match another",
            )
        if key in seen:
            raise MetadataError(
                f"duplicate key '{key}' (KV pair {index}; first at byte {seen[key].offset})",
                path=self.path,
                key=key,
                offset=start,
            )
        vtype = self._value_type(key)
        if vtype == GGUFValueType.ARRAY:
            element_offset = self.pos
            etype = self._value_type(key)
            if etype == GGUFValueType.ARRAY:
                raise MetadataError(
                    f"key '{key}' is an array of arrays; nested arrays are not supported",
                    path=self.path,
                    key=key,
                    offset=element_offset,
                )
            return KVEntry(key, vtype, self._array(key, etype), start)
        return KVEntry(key, vtype, self._value(key, vtype), start)

    def _value_type(self, key: str) -> GGUFValueType:
        offset = self.pos
        raw = self.i32(f"the value type of key '{key}'")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise MetadataError(
                f"key '{key}' has invalid value type {raw}",
                path=self.path,
                key=key,
                offset=offset,
            ) from None

    def _value(self, key: str, vtype: GGUFValueType) -> KVValue:
        if vtype == GGUFValueType.STRING:
            return GGUFString(self.raw_string(f"the value of key '{key}'", key=key))
        fmt, nbytes = SCALAR_FORMATS[vtype]
        if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
            # through the bits, never a C float: a signalling NaN keeps its payload
            self._need(nbytes, f"the value of key '{key}'")
            raw = bytes(self.data[self.pos : self.pos + nbytes])
            self.pos += nbytes
            return GGUFFloat.from_bytes(raw, self.endian)
        value = self._scalar(fmt, nbytes, f"the value of key '{key}'")
        if vtype == GGUFValueType.BOOL:
            return bool(value)
        return value  # type: ignore[no-any-return]

    def _array(self, key: str, etype: GGUFValueType) -> GGUFArray:
        count_offset = self.pos
        count = self.u64(f"the element count of key '{key}'")
        if count > MAX_ARRAY_ELEMENTS:
            raise MetadataError(
                f"key '{key}' has {count} array elements, more than the limit of {MAX_ARRAY_ELEMENTS}",
                path=self.path,
                key=key,
                offset=count_offset,
            )
        remain = self.size - self.pos
        start = self.pos
        if etype == GGUFValueType.STRING:
            if count * 8 > remain:
                raise TruncatedError(
                    f"key '{key}' declares {count} strings, more than the {remain} bytes that remain can hold",
                    path=self.path,
                    key=key,
                    offset=count_offset,
                )
            end = self._skip_strings(key, count)
        else:
            nbytes = count * SCALAR_FORMATS[etype][1]
            if nbytes > remain:
                raise TruncatedError(
                    f"key '{key}' declares {count} {etype.name} elements ({nbytes} bytes), "
                    f"but only {remain} bytes remain",
                    path=self.path,
                    key=key,
                    offset=count_offset,
                )
            end = start + nbytes
        self._fill(end)
        self.pos = end
        return GGUFArray(etype, count, self._copy(start, end), self.endian)

    def _skip_strings(self, key: str, count: int) -> int:
        """Find the end of ``count`` strings from the cursor without decoding them.

        Long arrays are scanned in blocks with numpy (:func:`.strings.chain_in_block`);
        what remains, and any block the scan cannot settle (a malformed element), is
        walked one string at a time, which reports the error where it is."""
        pos, first = self._scan_strings(count)
        return self._walk_strings(key, count, pos, first)

    def _scan_strings(self, count: int) -> tuple[int, int]:
        """Scan blocks of a string array from the cursor while at least
        :data:`_VECTOR_MIN_STRINGS` strings remain (none while numpy is not imported and
        the array is shorter than :data:`_IMPORT_WORTH_STRINGS`); returns the position and index of
        the first string not scanned.

        What is read for a block spans at most 8 bytes per string that remains (the
        least those strings take), so it never reaches past the array, and never past the
        file or the header limit: the bytes read are those the walk would read. While the
        usual case holds (:func:`.strings.usual_chain`), a block also takes in what the
        reads brought in beyond that (they double), which often holds the rest of the
        array (as far as a quarter more than the elements scanned so far take on average
        would reach); once it does not, blocks stay within those 8 bytes per string and
        are scanned by the exact method (:func:`.strings.chain_in_block`)."""
        pos = self.pos
        done = 0
        if not _scan_worth(count):
            return pos, done
        end_cap = self.size if self.limit is None else min(self.size, self.limit)
        usual = _BATCH
        while count - done >= _VECTOR_MIN_STRINGS:
            check(self.cancel)
            end = min(end_cap, pos + min(_SCAN_BLOCK_BYTES, 8 * (count - done)))
            if end - pos < 8:
                break
            self._fill(end)
            found = 0
            if usual:
                # the rest of the array at a quarter more than the average element so far
                guess = pos + (count - done) * (pos - self.pos) // done * 5 // 4 + 64 if done else end
                wide = max(end, min(len(self.data), pos + _SCAN_BLOCK_BYTES, guess))
                found, advance = usual_chain(self._view(pos, wide), count - done, self.endian)
                # on only while the chain ran to the array's end or past the block's
                usual = found == count - done or pos + advance > wide - 8
            if not found:
                found, advance = chain_in_block(self._view(pos, end), count - done, self.endian)
            if not found:
                break
            done += found
            pos += advance
        return pos, done

    def _walk_strings(self, key: str, count: int, pos: int, first: int) -> int:
        """Walk strings ``first`` to ``count`` of the array starting at the cursor, the
        first of them at ``pos``, one at a time; return the end of the array.

        The inner loop runs over the strings whose length prefix is already read, at most
        65,536 of them between checks of the cancel token, reading more when it stops."""
        data = self.data
        size = self.size
        unpack = struct.Struct(self.endian + "Q").unpack_from
        i = first
        while i < count:
            check(self.cancel)
            have = len(data) - 8
            if pos > have:
                if pos > size - 8:
                    raise TruncatedError(
                        f"unexpected end of file inside string {i} of key '{key}'",
                        path=self.path,
                        key=key,
                        offset=pos,
                    )
                self._fill(pos + 8)
                have = len(data) - 8
            stop = min(count, i + _CHECK_STRINGS_MASK + 1)
            start = i
            if _BATCH and len(data) <= MAX_STRING_BYTES:
                start, pos = batch.skip_strings(data, pos, start, stop, self.endian)
            for i in range(start, stop):
                if pos > have:
                    break
                (length,) = unpack(data, pos)
                if length > MAX_STRING_BYTES:
                    raise MetadataError(
                        f"string {i} of key '{key}' is {length} bytes, more than the limit of {MAX_STRING_BYTES}",
                        path=self.path,
                        key=key,
                        offset=pos,
                    )
                pos += 8 + length
            else:
                i = stop
        if pos > size:
            raise TruncatedError(
                f"the strings of key '{key}' run past the end of the file ({size} bytes)",
                path=self.path,
                key=key,
                offset=self.pos,
            )
        return pos

    def _tensor_info(self, index: int, seen: dict[str, TensorInfo]) -> TensorInfo:
        start = self.pos
        raw = self.raw_string(f"the name of tensor {index}", limit=MAX_NAME_BYTES)
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TensorInfoError(
                f"the name of tensor {index} is not valid UTF-8 ({raw!r})", path=self.path, offset=start
            ) from exc
        if "\0" in name:
            raise TensorInfoError(
                f"the name of tensor {index} contains a NUL byte ({raw!r})",
                path=self.path,
                offset=start,
                hint="llama.cpp cuts tensor names at the first NUL, so two such names could collide",
            )
        if name in seen:
            raise TensorInfoError(
                f"duplicate tensor name '{name}' (tensor {index}; first at byte {seen[name].info_offset})",
                path=self.path,
                tensor=name,
                offset=start,
            )
        dims_offset = self.pos
        n_dims = self.u32(f"the n_dims of tensor '{name}'")
        if n_dims > MAX_DIMS:
            raise TensorInfoError(
                f"tensor '{name}' has n_dims {n_dims}, it must be 0 to {MAX_DIMS}",
                path=self.path,
                tensor=name,
                offset=dims_offset,
            )
        ne: list[int] = []
        n_elements = 1
        for j in range(n_dims):
            dim_offset = self.pos
            d = self.i64(f"dimension {j} of tensor '{name}'")
            if d < 0:
                raise TensorInfoError(
                    f"tensor '{name}' dimension {j} is {d}, it must not be negative",
                    path=self.path,
                    tensor=name,
                    offset=dim_offset,
                )
            ne.append(d)
            n_elements *= d
        if n_elements > INT64_MAX:
            raise TensorInfoError(
                f"tensor '{name}' has shape {tuple(ne)}: its element count overflows 64 bits",
                path=self.path,
                tensor=name,
                offset=dims_offset,
            )
        type_offset = self.pos
        type_id = self.i32(f"the ggml type of tensor '{name}'")
        ggml_type = self._ggml_type(name, type_id, type_offset)
        ne0 = ne[0] if ne else 1  # ggml counts undeclared dimensions as 1
        if ne0 % ggml_type.block_size:
            raise TensorInfoError(
                f"tensor '{name}' has ne[0] = {ne0}, not a multiple of the {ggml_type.name} "
                f"block size {ggml_type.block_size}",
                path=self.path,
                tensor=name,
                offset=dims_offset,
            )
        nbytes = ggml_type.nbytes(tuple(ne))
        # the layout (strides) of the tensor must be representable even when a dimension
        # is 0, so the size with zero dimensions counted as 1 must fit in 63 bits
        layout_ne = (max(ne0, ggml_type.block_size), *(max(d, 1) for d in ne[1:]))
        if ggml_type.nbytes(layout_ne) > INT64_MAX:
            raise TensorInfoError(
                f"tensor '{name}' has shape {tuple(ne)}: its size in bytes overflows 63 bits",
                path=self.path,
                tensor=name,
                offset=dims_offset,
            )
        offset = self.u64(f"the data offset of tensor '{name}'")
        return TensorInfo(name, tuple(ne), ggml_type, offset, nbytes, start)

    def _ggml_type(self, name: str, type_id: int, offset: int) -> GGMLType:
        """The ggml type of id ``type_id``, which must be in ``[0, GGML_TYPE_COUNT)`` and not
        removed (``gguf.cpp`` sees block size 0 for a removed type and refuses it)."""
        ggml_type = GGML_TYPES.get(type_id)
        if ggml_type is not None:
            return ggml_type
        removed = REMOVED_GGML_TYPES.get(type_id)
        if removed is not None:
            raise TensorInfoError(
                f"tensor '{name}' has ggml type {type_id} ({removed.name}), which ggml no longer supports",
                path=self.path,
                tensor=name,
                offset=offset,
                hint="convert or quantize the model again with a current llama.cpp",
            )
        raise TensorInfoError(
            f"tensor '{name}' has unknown ggml type {type_id}, ggml types are 0 to {GGML_TYPE_COUNT - 1}",
            path=self.path,
            tensor=name,
            offset=offset,
            hint="the file may use a quantization newer than this hoist knows",
        )

    def _check_layout(self, tensors: list[TensorInfo], alignment: int) -> None:
        """Each tensor's offset is a multiple of the alignment and follows the previous
        tensor's padded end, as ``gguf.cpp`` requires."""
        expected = 0
        for info in tensors:
            if info.offset % alignment:
                raise TensorInfoError(
                    f"tensor '{info.name}' has data offset {info.offset}, not a multiple of the alignment {alignment}",
                    path=self.path,
                    tensor=info.name,
                    offset=info.info_offset,
                )
            if info.offset != expected:
                raise TensorInfoError(
                    f"tensor '{info.name}' has data offset {info.offset}, expected {expected}: "
                    "tensor data must follow the tensor infos' order, each padded to the alignment",
                    path=self.path,
                    tensor=info.name,
                    offset=info.info_offset,
                )
            expected += _align_up(info.nbytes, alignment)
