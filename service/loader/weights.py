"""The weights index: every tensor of a model by name, with the file, absolute offset and
size of its data (llama.cpp's ``weights_map`` of ``llama_tensor_weight``).
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from typing import NamedTuple

from service.cancel import CancelToken, check
from service.errors import HeaderTooLargeError, SplitError, TensorBoundsError
from service.loader.gguf import GGUFFile, HeaderLimits, TensorInfo, read_gguf

KEY_SPLIT_NO = "split.no"
KEY_SPLIT_COUNT = "split.count"
KEY_SPLIT_TENSORS_COUNT = "split.tensors.count"

LLAMA_MAX_LAYERS = 512
"""Most repeating layers a model may have (llama.cpp's ``LLAMA_MAX_LAYERS``)."""

_LAYER = re.compile(r"blk\.[ \t\n\r\f\v]*([+-]?\d+)\.")


def layer_of(name: str) -> int:
    """The layer number in a ``blk.N.`` tensor name, or -1 (llama.cpp's
    ``weight_name_comparer`` reads it with ``sscanf("blk.%d.")``)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def load_order_key(name: str) -> tuple[int, str]:
    """Sort key of the load order: by layer number (numeric), then by name."""
    return (layer_of(name), name)


class TensorWeight(NamedTuple):
    """Where one tensor's data lives (a named tuple: the index makes one per tensor).

    Attributes:
        name: the tensor name.
        file_index: index of the file (split) holding the data.
        offset: absolute byte offset of the data in that file.
        nbytes: size of the data in bytes.
        info: the tensor info (ne, ggml type, ...).
    """

    name: str
    file_index: int
    offset: int
    nbytes: int
    info: TensorInfo

    @property
    def end(self) -> int:
        """Absolute byte offset just past the data."""
        return self.offset + self.nbytes


class WeightIndex:
    """All tensors of a model, merged over its files, in load order.

    Attributes:
        files: the parsed GGUF files; ``files[0]`` holds the model's metadata.
        weights: tensor name -> :class:`TensorWeight`, ordered by layer number then name.
    """

    def __init__(self, files: list[GGUFFile]) -> None:
        """Index the tensors of ``files`` (the splits of one model, first split first).

        Raises:
            TensorBoundsError: a tensor's data lies outside its file.
            SplitError: a tensor appears in two files.
        """
        self.files = files
        found: dict[str, TensorWeight] = {}
        for file_index, gguf_file in enumerate(files):
            for info in gguf_file.tensors:
                seen = found.get(info.name)
                if seen is not None:
                    raise SplitError(
                        f"tensor '{info.name}' is duplicated: it is also in {files[seen.file_index].path}",
                        path=gguf_file.path,
                        tensor=info.name,
                        offset=info.info_offset,
                    )
                found[info.name] = _weight(gguf_file, file_index, info)
        self.weights = {name: found[name] for name in sorted(found, key=load_order_key)}

    @property
    def path(self) -> str:
        """The model's first (or only) file."""
        return self.files[0].path

    @property
    def metadata(self) -> GGUFFile:
        """The file holding the model's KV metadata (the first split)."""
        return self.files[0]

    @property
    def byte_order(self) -> str:
        """``"little"`` or ``"big"`` (of the first file)."""
        return self.files[0].byte_order

    @cached_property
    def nbytes(self) -> int:
        """Total tensor data in bytes (``n_bytes``, without padding)."""
        return sum(w.nbytes for w in self.weights.values())

    @cached_property
    def n_elements(self) -> int:
        """Total number of elements over all tensors."""
        return sum(w.info.n_elements for w in self.weights.values())

    @property
    def bpw(self) -> float:
        """Bits per weight: ``nbytes * 8 / n_elements`` (0 for an empty model)."""
        return self.nbytes * 8 / self.n_elements if self.n_elements else 0.0

    def __len__(self) -> int:
        return len(self.weights)

    def __getitem__(self, name: str) -> TensorWeight:
        return self.weights[name]


def _weight(gguf_file: GGUFFile, file_index: int, info: TensorInfo) -> TensorWeight:
    """The weight of ``info`` in ``gguf_file``, checked to lie inside the file
    (``llama_tensor_weight``: ``offs + nbytes`` neither overflows nor passes the end)."""
    offset = gguf_file.data_offset + info.offset
    end = offset + info.nbytes
    if end >= 1 << 64 or end > gguf_file.file_size:
        raise TensorBoundsError(
            f"tensor '{info.name}' data [{offset}, {end}) ends past the end of the file ({gguf_file.file_size} bytes)",
            path=gguf_file.path,
            tensor=info.name,
            offset=offset,
            hint="the file is corrupted or incomplete (an interrupted download?)",
        )
    return TensorWeight(info.name, file_index, offset, info.nbytes, info)


_SPLIT_SUFFIX = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def split_path(prefix: str, split_no: int, split_count: int) -> str:
    """The path of split ``split_no`` (0-based) of ``split_count``: llama.cpp's
    ``llama_split_path``, ``PREFIX-%05d-of-%05d.gguf`` numbered from 1."""
    return f"{prefix}-{split_no + 1:05d}-of-{split_count:05d}.gguf"


def split_prefix(path: str, split_no: int, split_count: int) -> str | None:
    """The prefix of ``path`` if it is named as split ``split_no`` of ``split_count``
    (llama.cpp's ``llama_split_prefix``), else None."""
    suffix = f"-{split_no + 1:05d}-of-{split_count:05d}.gguf"
    if len(path) <= len(suffix) or not path.endswith(suffix):
        return None
    return path[: -len(suffix)]


def _split_int(gguf_file: GGUFFile, key: str) -> int | None:
    entry = gguf_file.kv.get(key)
    if entry is None:
        return None
    if isinstance(entry.value, bool) or not isinstance(entry.value, int):
        raise SplitError(
            f"'{key}' has type {entry.type_name}, expected an integer",
            path=gguf_file.path,
            key=key,
            offset=entry.offset,
        )
    return entry.value


def _required_split_int(gguf_file: GGUFFile, key: str) -> int:
    value = _split_int(gguf_file, key)
    if value is None:
        raise SplitError(f"'{key}' is missing from a split file", path=gguf_file.path, key=key)
    return value


def _inside(root: str, path: str) -> bool:
    real = os.path.realpath(path)
    return os.path.commonpath([root, real]) == root


class _Budget:
    """What the header limits leave for the remaining splits of a model: bytes count as
    read, not as the headers declare, so that many small headers cannot make each read
    a large chunk."""

    def __init__(self, limits: HeaderLimits | None, first: GGUFFile) -> None:
        self.limits = limits
        self.nbytes = max(first.data_offset, first.nbytes_read)
        self.tensors = len(first.tensors)
        self.kv = len(first.kv)

    def remaining(self) -> HeaderLimits | None:
        if self.limits is None:
            return None
        lim = self.limits
        return HeaderLimits(
            None if lim.max_bytes is None else max(lim.max_bytes - self.nbytes, 0),
            None if lim.max_kv is None else max(lim.max_kv - self.kv, 0),
            None if lim.max_tensors is None else max(lim.max_tensors - self.tensors, 0),
        )

    def spend(self, gguf_file: GGUFFile) -> None:
        self.nbytes += max(gguf_file.data_offset, gguf_file.nbytes_read)
        self.tensors += len(gguf_file.tensors)
        self.kv += len(gguf_file.kv)


MAX_SPLITS = 65535
"""Most splits a model may have (``split.count`` is a u16 in llama.cpp)."""


def open_model(
    path: str | os.PathLike[str],
    *,
    root: str | None = None,
    cancel: CancelToken | None = None,
    limits: HeaderLimits | None = None,
) -> WeightIndex:
    """Parse the GGUF model at ``path`` (a single file, or the first split of a split
    model) and index its tensors.

    Splits (llama.cpp's ``llama_model_loader``): when ``split.count`` > 1, ``path`` must be
    the first split (``split.no`` = 0); its siblings ``PREFIX-%05d-of-%05d.gguf`` are read
    from the same directory, each with its own data offset, and must carry the matching
    ``split.no``; the tensors found in all splits must number ``split.tensors.count``.

    Args:
        path: the model file, or its first split.
        root: when given, every split must resolve inside this directory, as named and
            as opened (a symbolic link swapped in between cannot lead outside).
        cancel: checked while headers are parsed and between splits.
        limits: bounds on the headers of all splits together (bytes, KV pairs, tensors).

    Returns:
        The :class:`WeightIndex`.

    Raises:
        StorageError: a file cannot be opened or read.
        FormatError: a file is not valid GGUF, or a tensor's data lies outside its file.
        SplitError: not the first split, a sibling missing, misnumbered, outside ``root``
            or of another byte order, a tensor in two splits, or a tensor count other than
            ``split.tensors.count``, or more than :data:`MAX_SPLITS` splits.
        RequestAbandonedError, WorkLimitError: from ``cancel``.
        RequestError: the first file, as opened, lies outside ``root``.
        HeaderTooLargeError: a header, or the headers together, over ``limits``.
    """
    name = os.fspath(path)
    first = read_gguf(name, cancel=cancel, root=root, limits=limits)
    budget = _Budget(limits, first)
    n_split = _split_int(first, KEY_SPLIT_COUNT) or 0
    if n_split <= 1:
        return WeightIndex([first])
    if n_split > MAX_SPLITS:
        raise SplitError(
            f"split.count is {n_split}, at most {MAX_SPLITS} splits are allowed", path=name, key=KEY_SPLIT_COUNT
        )
    if limits is not None and limits.max_splits is not None and n_split > limits.max_splits:
        raise HeaderTooLargeError(
            f"split.count is {n_split}, more than the limit of {limits.max_splits} splits",
            path=name,
            key=KEY_SPLIT_COUNT,
        )
    split_no = _required_split_int(first, KEY_SPLIT_NO)
    prefix = split_prefix(name, split_no, n_split)
    if split_no != 0:
        where = f": load {split_path(prefix, 0, n_split)} instead" if prefix is not None else ""
        raise SplitError(
            f"this file is split {split_no + 1} of {n_split} (split.no = {split_no}); a split model "
            f"must be loaded from its first split{where}",
            path=name,
            key=KEY_SPLIT_NO,
        )
    if prefix is None:
        raise SplitError(
            f"the first of {n_split} splits must be named PREFIX-00001-of-{n_split:05d}.gguf "
            "so that its siblings can be found",
            path=name,
        )
    files = [first]
    real_root = os.path.realpath(root) if root is not None else None
    for i in range(1, n_split):
        check(cancel)
        sibling = split_path(prefix, i, n_split)
        if not os.path.lexists(sibling):
            raise SplitError(f"split {i + 1} of {n_split} is missing: {sibling} does not exist", path=name)
        if real_root is not None and not _inside(real_root, sibling):
            raise SplitError(f"split {i + 1} of {n_split} leaves the models directory", path=sibling)
        try:
            gguf_file = read_gguf(sibling, cancel=cancel, root=root, limits=budget.remaining())
        except HeaderTooLargeError as exc:
            raise HeaderTooLargeError(
                f"the headers of the {n_split} splits are larger together than the limit "
                f"(reading split {i + 1}: {exc.message})",
                path=sibling,
            ) from None
        budget.spend(gguf_file)
        found_no = _required_split_int(gguf_file, KEY_SPLIT_NO)
        if found_no != i:
            raise SplitError(
                f"split.no is {found_no}, expected {i} for split {i + 1} of {n_split}",
                path=sibling,
                key=KEY_SPLIT_NO,
            )
        if gguf_file.byte_order != first.byte_order:
            raise SplitError(
                f"split {i + 1} is {gguf_file.byte_order}-endian but the first split is {first.byte_order}-endian",
                path=sibling,
            )
        files.append(gguf_file)
    index = WeightIndex(files)
    expected = _required_split_int(first, KEY_SPLIT_TENSORS_COUNT)
    if expected != len(index):
        raise SplitError(
            f"corrupted model: split.tensors.count is {expected} but the {n_split} splits hold {len(index)} tensors",
            path=name,
            key=KEY_SPLIT_TENSORS_COUNT,
        )
    return index
